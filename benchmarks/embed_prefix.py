"""A last-token-pooled decoder embedder with a shared instruction, Prelude alone: embeddings/s
with the instruction served from the prefix cache vs computed for every text.

    python -m benchmarks.embed_prefix [--texts 2000] [--instruction 64] [--dtype float32]

A random-weight Qwen3 trunk (by default hidden 512, 8 layers: a small embedder a shared
CPU can run in minutes), token ids drawn at random: `--texts` texts of 32-128 tokens after
one `--instruction`-token instruction, normalized last-token embeddings. Both runs use one
engine build each in this process, the texts submitted at once and stepped to the end; the
first run's vectors are checked against the second's (the cache must not change them).
Writes JSON.
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
from prelude.engine.request import PoolingParams, PoolingTask
from prelude.executor.runner import ModelRunner
from prelude.model.registry import config_for
from prelude.params import SamplingParams
from prelude.testing.random_model import random_weights


class _Ids:
    """The engine's tokenizer where every input is token ids."""

    vocab_size = 32000
    bos_token_id = None
    eos_token_ids = frozenset({0})
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def _engine(cfg: dict[str, Any], weights: dict[str, torch.Tensor], dtype: str, caching: bool,
            budget: int) -> LLMEngine:
    executor = ExecutorConfig(device="cpu", dtype=dtype)
    runner = ModelRunner.create(config_for(cfg), dict(weights), executor, 16)
    engine_cfg = EngineConfig(executor=executor, cache=CacheConfig(block_size=16, enable_prefix_caching=caching),
                              scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=256))
    return LLMEngine(runner, _Ids(), engine_cfg, "random-qwen3-embedder")  # type: ignore[arg-type]


def _run(engine: LLMEngine, texts: list[list[int]]) -> tuple[float, dict[str, list[float]]]:
    pooling = PoolingParams(PoolingTask.EMBED, pooling="last", normalize=True)
    start = time.perf_counter()
    for i, ids in enumerate(texts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=0), pooling)
    vectors: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                vectors[out.request_id] = list(out.embedding or ())
    return time.perf_counter() - start, vectors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--instruction", type=int, default=64, help="tokens of the shared instruction")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--budget", type=int, default=2048, help="tokens a step computes at most")
    ap.add_argument("--out", default="results/embed_prefix.json")
    args = ap.parse_args()
    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": _Ids.vocab_size,
           "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
           "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 128),
           "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 4096,
           "tie_word_embeddings": True, "hidden_act": "silu"}
    weights = random_weights(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    instruction = torch.randint(1, _Ids.vocab_size, (args.instruction,), generator=gen).tolist()
    texts = [instruction + torch.randint(1, _Ids.vocab_size, (int(n),), generator=gen).tolist()
             for n in torch.randint(32, 129, (args.texts,), generator=gen)]
    results: dict[str, Any] = {"texts": args.texts, "instruction_tokens": args.instruction, "hidden": args.hidden,
                               "layers": args.layers, "dtype": args.dtype, "cpus": os.cpu_count(),
                               "loadavg": os.getloadavg()[0]}
    runs = {}
    for name, caching in (("cold", False), ("cached", True)):
        engine = _engine(cfg, weights, args.dtype, caching, args.budget)
        _run(engine, texts[:16])  # warm-up: kernels built, packed copies made
        seconds, vectors = _run(engine, texts)
        runs[name] = vectors
        results[name] = {"seconds": seconds, "embeddings_per_s": args.texts / seconds,
                         "tokens_computed": engine.kv.stats.computed_tokens, "tokens_reused": engine.kv.stats.reused_tokens}
        print(f"{name}: {args.texts / seconds:.1f} embeddings/s ({seconds:.2f} s)")
    worst = max(float((torch.tensor(runs["cold"][k]) - torch.tensor(runs["cached"][k])).abs().max()) for k in runs["cold"])
    results["max_abs_difference"] = worst
    results["speedup"] = results["cached"]["embeddings_per_s"] / results["cold"]["embeddings_per_s"]
    print(f"cached / cold: {results['speedup']:.2f}x; largest difference between the vectors {worst:.2e}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
