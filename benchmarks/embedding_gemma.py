"""An EmbeddingGemma-shaped bidirectional encoder on the CPU: Prelude's engine against the
transformers forward that sentence-transformers runs (batches of 32 sorted by length,
padded, masked mean pooling, normalized), embeddings/s on the same texts and threads.

    python -m benchmarks.embedding_gemma [--texts 128] [--long 4] [--dtype float32] [--vocab 32768] [--layers 24]

Random weights from google/embeddinggemma-300m's config (24 layers, 20 of them sliding a
512-token window, hidden 768, 3 heads of 256); the vocabulary is cut to `--vocab` rows by
default (it changes no compute, only memory), its layers to `--layers` where asked (the
pattern kept: every sixth global). Token ids drawn at random: `--texts` texts
of 32-256 tokens, then `--long` texts of 2,048 (four windows). Each side runs once to warm
up, then is timed; the vectors are compared (smallest cosine). Writes JSON.
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
from prelude.model.loading.files import base_model_names
from prelude.model.registry import config_for
from prelude.params import PoolingParams, PoolingTask, SamplingParams

PUBLISHED: dict[str, Any] = {
    "architectures": ["Gemma3TextModel"], "model_type": "gemma3_text", "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 768, "intermediate_size": 1152,
    "max_position_embeddings": 2048, "num_attention_heads": 3, "num_hidden_layers": 24, "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
    "sliding_window": 512, "use_bidirectional_attention": True, "pad_token_id": 0, "eos_token_id": 1,
    "bos_token_id": 2,
}


class _Ids:
    """The engine's tokenizer where every input is token ids."""

    bos_token_id = None
    eos_token_ids = frozenset({1})
    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def _prelude(raw: dict[str, Any], weights: dict[str, torch.Tensor], dtype: str, vocab: int) -> LLMEngine:
    executor = ExecutorConfig(device="cpu", dtype=dtype)
    runner = ModelRunner.create(config_for(raw), base_model_names(dict(weights)), executor, 16)
    engine_cfg = EngineConfig(executor=executor, cache=CacheConfig(block_size=16),
                              scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256))
    return LLMEngine(runner, _Ids(vocab), engine_cfg, "random-embeddinggemma")  # type: ignore[arg-type]


def _run_prelude(engine: LLMEngine, texts: list[list[int]]) -> tuple[float, list[list[float]]]:
    pooling = PoolingParams(PoolingTask.EMBED, pooling="mean", normalize=True)
    start = time.perf_counter()
    for i, ids in enumerate(texts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=0), pooling)
    vectors: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                vectors[out.request_id] = list(out.embedding or ())
    return time.perf_counter() - start, [vectors[str(i)] for i in range(len(texts))]


@torch.inference_mode()
def _run_transformers(model: Any, texts: list[list[int]], batch: int) -> tuple[float, list[list[float]]]:
    """sentence-transformers' encode: longest first, batches padded, masked mean, normalized."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out: dict[int, list[float]] = {}
    start = time.perf_counter()
    for at in range(0, len(order), batch):
        group = order[at:at + batch]
        width = max(len(texts[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, :len(texts[i])] = torch.tensor(texts[i])
            mask[row, :len(texts[i])] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        for row, i in enumerate(group):
            out[i] = torch.nn.functional.normalize(pooled[row], dim=-1).tolist()
    return time.perf_counter() - start, [out[i] for i in range(len(texts))]


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=128, help="texts of 32-256 tokens")
    ap.add_argument("--long", type=int, default=4, help="texts of 2,048 tokens")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32, help="the transformers side's batch (sentence-transformers')")
    ap.add_argument("--out", default="results/embedding_gemma.json")
    args = ap.parse_args()
    raw = {**PUBLISHED, "vocab_size": args.vocab, "num_hidden_layers": args.layers,
           "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(args.layers)]}
    torch.manual_seed(0)
    hf_cfg = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    model = transformers.Gemma3TextModel(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    dtype = getattr(torch, args.dtype)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = model.to(dtype)
    gen = torch.Generator().manual_seed(0)
    texts = [torch.randint(3, args.vocab, (int(n),), generator=gen).tolist()
             for n in torch.randint(32, 257, (args.texts,), generator=gen)]
    texts += [torch.randint(3, args.vocab, (2048,), generator=gen).tolist() for _ in range(args.long)]
    tokens = sum(map(len, texts))
    engine = _prelude(raw, weights, args.dtype, args.vocab)
    results: dict[str, Any] = {"texts": len(texts), "tokens": tokens, "long_texts": args.long, "dtype": args.dtype,
                               "vocab": args.vocab, "layers": args.layers, "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                               "loadavg": os.getloadavg()[0]}
    _run_prelude(engine, texts[:8] + texts[-1:])  # warm-up: kernels built, packed copies made
    _run_transformers(model, texts[:8] + texts[-1:], args.batch)
    runs = {}
    for name, run in (("prelude", lambda: _run_prelude(engine, texts)),
                      ("transformers", lambda: _run_transformers(model, texts, args.batch))):
        seconds, vectors = run()
        runs[name] = torch.tensor(vectors, dtype=torch.float64)
        results[name] = {"seconds": seconds, "embeddings_per_s": len(texts) / seconds, "tokens_per_s": tokens / seconds}
        print(f"{name}: {len(texts) / seconds:.2f} embeddings/s, {tokens / seconds:.0f} tokens/s ({seconds:.2f} s)")
    cos = torch.nn.functional.cosine_similarity(runs["prelude"], runs["transformers"], dim=-1)
    results["min_cosine"] = float(cos.min())
    results["speedup"] = results["prelude"]["embeddings_per_s"] / results["transformers"]["embeddings_per_s"]
    print(f"prelude / transformers: {results['speedup']:.2f}x; smallest cosine between the vectors "
          f"{results['min_cosine']:.6f}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
