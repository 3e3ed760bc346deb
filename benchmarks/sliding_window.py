"""Gemma 3's sliding layers keep a window of KV: a random-weight model of Gemma-3-1B's layer
shape (hidden 1152, 4 query heads, 1 KV head of 256, window 512, one global layer after
five sliding ones) with its layers cut (`--layers`, default 6) and its vocab cut, in the
engine, in-process:

    python -m benchmarks.sliding_window [--dtype bfloat16] [--layers 6] [--windows 4] [--decode 32]

One prompt `--windows` windows long (chunks of --chunk tokens), then `--decode` greedy
tokens. After every step it records the blocks the request holds in the sliding layers'
pool and in the global layers' pool; the goal: at most window / block + 1 blocks on each
sliding layer while the prompt and its decode run, all of them back in the pool after.
Also times one sliding layer's attention over the window pool (a 512-token chunk after 1,536
cached tokens; 16 decode rows at 2,048): the C kernel with its window against the torch
backend with the window as a mask. Prints the figures and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from prelude.bench.results import write_json
from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
from prelude.engine.engine import LLMEngine
from prelude.executor.runner import ModelRunner
from prelude.model.registry import config_for
from prelude.params import SamplingParams

GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "max_position_embeddings": 32768,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "eos_token_id": 1, "bos_token_id": 2,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}


class _Ids:
    """The engine's tokenizer where every input is token ids."""

    bos_token_id = None
    eos_token_ids = frozenset({1})
    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def random_gemma3_weights(cfg: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named Gemma 3 weights ((1 + w) norms at zero), scaled so activations stay finite."""
    gen = torch.Generator().manual_seed(seed)
    h, ff, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    w = {"model.embed_tokens.weight": r(cfg["vocab_size"], h), "model.norm.weight": zeros(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + n: zeros(h) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                          "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")}
        w |= {p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
              p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
              p + "self_attn.q_norm.weight": zeros(d), p + "self_attn.k_norm.weight": zeros(d),
              p + "mlp.gate_proj.weight": r(ff, h), p + "mlp.up_proj.weight": r(ff, h),
              p + "mlp.down_proj.weight": r(h, ff)}
    return w


def time_attention(dtype: torch.dtype, window: int = 512, bs: int = 16, repeats: int = 5) -> dict[str, float]:
    """One sliding layer's attention (Gemma-3-1B's heads: 4 query heads, 1 KV head of 256) over
    a window pool: a 512-token chunk after 1,536 cached tokens, and 16 decode rows at 2,048
    tokens; the C kernel with its window against the torch backend with the window as a mask.
    Milliseconds a call, the best of `repeats`."""
    from prelude.model.attention.cpu_backend import load_cpu_attention
    from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillSlice
    from prelude.model.attention.torch_backend import TorchAttention

    gen = torch.Generator().manual_seed(0)
    per_row = 2048 // bs
    rows = 17
    scratch = rows * per_row
    kc = torch.randn(scratch + 1, bs, 1, 256, generator=gen).to(dtype)
    vc = torch.randn(scratch + 1, bs, 1, 256, generator=gen).to(dtype)
    tables = torch.arange(rows * per_row).view(rows, per_row)
    for r in range(rows):  # the entries behind each row's window are released (the scratch block)
        first_query = 1536 if r == 0 else 2047
        tables[r, : max(0, first_query - window + 1) // bs] = scratch
    out: dict[str, float] = {}
    for name, n_new in (("chunk_512_after_1536", 512), ("decode_16_rows_at_2048", 1)):
        if n_new > 1:
            slots = tables[0, 1536 // bs:].repeat_interleave(bs) * bs + torch.arange(512) % bs
            meta = AttentionMetadata(slots, (PrefillSlice(0, 512, 2048, tables[0]),), None, bs)
        else:
            slots = tables[1:, 2047 // bs] * bs + 2047 % bs
            meta = AttentionMetadata(slots, (), DecodeRows(torch.arange(16), tables[1:], torch.full((16,), 2048), 2048),
                                     bs)
        t = meta.slot_mapping.numel()  # type: ignore[union-attr]
        q = torch.randn(t, 4, 256, generator=gen).to(dtype)
        k = torch.randn(t, 1, 256, generator=gen).to(dtype)
        v = torch.randn(t, 1, 256, generator=gen).to(dtype)
        for backend_name, backend in (("cpu", load_cpu_attention()), ("torch", TorchAttention())):
            if backend is None:
                continue
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                backend.forward(q, k, v, kc, vc, meta, 256 ** -0.5, window=window)
                best = min(best, time.perf_counter() - start)
            out[f"{name}_{backend_name}_ms"] = round(best * 1e3, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=4, help="the prompt's length in windows")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--out", default="benchmarks/results/sliding_window.json")
    args = ap.parse_args()
    cfg = {**GEMMA3_1B, "num_hidden_layers": args.layers, "vocab_size": args.vocab}
    bs = 16
    executor = ExecutorConfig(device="cpu", dtype=args.dtype, attention_backend=args.backend)
    runner = ModelRunner.create(config_for(cfg), random_gemma3_weights(cfg, getattr(torch, args.dtype)), executor, bs)
    engine = LLMEngine(runner, _Ids(args.vocab), EngineConfig(  # type: ignore[arg-type]
        executor=executor, cache=CacheConfig(block_size=bs),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk, max_num_seqs=16)), "random-gemma-3-1b-shape")
    windows = engine.kv.windows
    assert windows is not None, "the engine made no window pool"
    window = windows.window
    prompt = torch.randint(3, args.vocab, (args.windows * window,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=args.decode, ignore_eos=True))
    steps: list[dict[str, int]] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        table = windows.table("long")
        if table:
            steps.append({"tokens_computed": engine._requests["long"].num_computed_tokens,
                          "window_blocks_held": sum(b >= 0 for b in table),
                          "global_blocks_held": len(engine.kv.block_table("long"))})
        engine.check_integrity()
    seconds = time.perf_counter() - start
    bound = window // bs + 1
    most = max(s["window_blocks_held"] for s in steps)
    sliding = engine.runner.model.config.layer_kinds.count("sliding")  # type: ignore[union-attr]
    per_layer_block = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * torch.tensor([], dtype=getattr(
        torch, args.dtype)).element_size() * bs
    result = {
        "model": f"random Gemma-3-1B layer shape, {args.layers} layers ({sliding} sliding), vocab {args.vocab}",
        "dtype": args.dtype, "backend": args.backend, "block_size": bs, "window": window,
        "prompt_tokens": len(prompt), "decode_tokens": args.decode, "chunk": args.chunk,
        "bound_blocks_per_sliding_layer": bound,
        "max_window_blocks_held": most,
        "max_window_tokens_held": most * bs,
        "global_blocks_held_at_end": steps[-1]["global_blocks_held"],
        "kv_bytes_held_per_sliding_layer_max": most * per_layer_block,
        "kv_bytes_per_sliding_layer_without_the_bound": steps[-1]["global_blocks_held"] * per_layer_block,
        "window_pool_blocks": windows.pool.num_blocks,
        "window_pool_blocks_available_after": windows.pool.num_available_blocks,
        "within_bound": most <= bound and windows.pool.num_available_blocks == windows.pool.num_blocks,
        "sliding_layer_attention": time_attention(getattr(torch, args.dtype)),
        "steps": steps, "seconds": round(seconds, 2), "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    print(f"window {window}, block {bs}: the request held at most {most} window blocks ({most * bs} tokens) on each "
          f"of {sliding} sliding layers (bound {bound}), {steps[-1]['global_blocks_held']} blocks on each global "
          f"layer; after it: {windows.pool.num_available_blocks}/{windows.pool.num_blocks} window blocks "
          f"available; {seconds:.1f} s")
    print("one sliding layer's attention (ms, best of 5):", result["sliding_layer_attention"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
