"""A hybrid model (random-weight Qwen3.5 of the smallest shape: 18 Gated DeltaNet and 6 gated
attention layers) in the engine, Prelude alone, in-process (no HTTP):

    python -m benchmarks.hybrid_engine [--dtype bfloat16] [--vocab 49152] [--scale 1.0]

- oneshot_512x1: 16 prompts of 512 tokens, one token each (OneShot rows: no state slot);
- paged_128x32: 4 prompts of 128 tokens, 32 greedy tokens each (one state slot each);
- mixed: 64 OneShot prompts of 128 tokens beside 8 decodes of 32 tokens with 8 slots: the
  OneShot rows must hold no slot and nothing may be refused;
- judge_1024+64: a 1,024-token rubric + 64 new tokens, one token out, 16 in flight (a new
  request as each one ends), 64 requests; judge_256+32: a 256-token rubric + 32 new. Each
  reports req/s and the fraction of the rubric's tokens served from the prefix cache (the
  state checkpoints) after the first wave (requests 17 on), with the checkpoint counts.
`--scale` multiplies the request counts (0.25: a quick look). Token ids at random; the vocab
is cut (`--vocab`) as peers' runs of this shape were. Writes JSON.

`--alternate N`: each scenario N times with the linear layers' C kernels off (the torch
rows, PRELUDE_DELTA_RULE=0) and on, alternating, in one process on one engine: old vs new
on a loaded machine.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

import torch

from prelude.bench.results import write_json
from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
from prelude.engine.engine import LLMEngine
from prelude.executor.runner import ModelRunner
from prelude.kernels.cpu.delta_rule import SWITCH
from prelude.model.registry import config_for
from prelude.params import SamplingParams
from prelude.testing.random_model import SHAPES, random_hybrid_weights


class _Ids:
    """The engine's tokenizer where every input is token ids."""

    vocab_size = 49152
    bos_token_id = None
    eos_token_ids = frozenset({0})
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def _engine(dtype: str, vocab: int, slots: int) -> LLMEngine:
    cfg = {**SHAPES["qwen3.5-0.8b"], "vocab_size": vocab}
    executor = ExecutorConfig(device="cpu", dtype=dtype)
    weights = random_hybrid_weights(cfg, dtype=getattr(torch, dtype))
    runner = ModelRunner.create(config_for(cfg), weights, executor, 16)
    engine_cfg = EngineConfig(executor=executor, cache=CacheConfig(block_size=16, max_recurrent_slots=slots),
                              scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64))
    tokenizer = _Ids()
    tokenizer.vocab_size = vocab
    return LLMEngine(runner, tokenizer, engine_cfg, "random-qwen3.5-0.8b")  # type: ignore[arg-type]


def _judge(engine: LLMEngine, rubric_len: int, new_len: int, total: int, concurrency: int, vocab: int,
           seed: int) -> dict[str, float]:
    """Closed loop: `concurrency` judge requests in flight (a rubric shared by all, then
    tokens of their own), a new one as each ends, `total` in all."""
    rubric = _prompts(1, rubric_len, vocab, seed)[0]
    items = _prompts(total, new_len, vocab, seed + 1)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    saved, evicted = engine.kv.stats.checkpoints_saved, engine.metrics()["state_checkpoints_evicted_total"]
    start = time.perf_counter()
    sent, done = 0, 0
    cached_after_first_wave: list[int] = []
    while done < total:
        while sent < total and sent - done < concurrency:
            engine.add_request(f"judge{rubric_len}-{sent}-{start}", rubric + items[sent], one)
            sent += 1
        for out in engine.step():
            if out.finished:
                if int(out.request_id.split("-")[1]) >= concurrency:
                    cached_after_first_wave.append(min(out.num_cached_tokens, rubric_len))
                done += 1
    seconds = time.perf_counter() - start
    engine.check_integrity()
    return {"seconds": seconds, "requests": total, "concurrency": concurrency, "requests_per_s": total / seconds,
            "rubric_hit_fraction_after_first_wave":
                sum(cached_after_first_wave) / (rubric_len * len(cached_after_first_wave))
                if cached_after_first_wave else 0.0,
            "checkpoints_saved": engine.kv.stats.checkpoints_saved - saved,
            "checkpoints_evicted": engine.metrics()["state_checkpoints_evicted_total"] - evicted}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def _run(engine: LLMEngine, jobs: list[tuple[list[int], SamplingParams]]) -> dict[str, float]:
    """Submit `jobs` at once and step to the end; also the most state slots held at once by
    the OneShot ones (their max_tokens is 1: they must hold none)."""
    start = time.perf_counter()
    oneshot = set()
    for i, (ids, params) in enumerate(jobs):
        rid = f"r{i}-{start}"
        engine.add_request(rid, ids, params)
        if params.max_tokens == 1:
            oneshot.add(rid)
    out_tokens = 0
    oneshot_slots = 0
    while engine.has_unfinished():
        for out in engine.step():
            out_tokens += len(out.new_token_ids)
        oneshot_slots = max(oneshot_slots, sum(engine.kv.state_slot(rid) is not None for rid in oneshot))
    seconds = time.perf_counter() - start
    engine.check_integrity()
    return {"seconds": seconds, "requests_per_s": len(jobs) / seconds, "output_tokens_per_s": out_tokens / seconds,
            "max_slots_held_by_oneshot": oneshot_slots}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--alternate", type=int, default=0, metavar="N")
    p.add_argument("--out", default="benchmarks/results/hybrid_engine.json")
    p.add_argument("--only", default=None, help="run only the scenarios whose names start with this")
    args = p.parse_args()
    n = lambda k: max(1, int(k * args.scale))  # noqa: E731
    engine = _engine(args.dtype, args.vocab, slots=8)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    chat = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    _run(engine, [(q, one) for q in _prompts(2, 64, args.vocab, 0)])  # warm-up: packed copies, first calls
    results: dict[str, Any] = {"cpu_count": os.cpu_count(), "dtype": args.dtype, "vocab": args.vocab,
                               "state_slots": engine.num_state_slots,
                               "state_mib_per_slot": engine.info.state_bytes_per_slot / 2**20,
                               "state_checkpoint_slots": engine.num_checkpoint_slots,
                               "state_checkpoint_stride": engine.config.cache.state_checkpoint_stride}
    # `salt` moves the prompts' seeds: a scenario run again (--alternate) meets a cold cache
    scenarios = {
        "oneshot_512x1": lambda salt: _run(engine, [(q, one) for q in _prompts(n(16), 512, args.vocab, 1 + salt)]),
        "paged_128x32": lambda salt: _run(engine, [(q, chat) for q in _prompts(n(4), 128, args.vocab, 2 + salt)]),
        "mixed_oneshot_beside_decodes": lambda salt: _run(
            engine, [(q, one) for q in _prompts(n(64), 128, args.vocab, 3 + salt)] +
            [(q, chat) for q in _prompts(min(8, n(8)), 128, args.vocab, 4 + salt)]),
        "judge_1024+64": lambda salt: _judge(engine, 1024, 64, n(64), 16, args.vocab, 5 + salt),
        "judge_256+32": lambda salt: _judge(engine, 256, 32, n(64), 16, args.vocab, 7 + salt),
    }
    for name, scenario in scenarios.items():
        if args.only is not None and not name.startswith(args.only):
            continue
        if not args.alternate:
            results[name] = scenario(0)
            continue
        for i in range(args.alternate):
            for j, (label, switch) in enumerate((("torch_rows", "0"), ("c_kernels", "1"))):
                os.environ[SWITCH] = switch
                figures = scenario(100 * (2 * i + j + 1))
                results[f"{name}/{label}/{i}"] = figures
                print(f"{name}/{label}/{i}: {figures}", flush=True)
        os.environ.pop(SWITCH)
    for name, figures in results.items():
        print(f"{name}: {figures}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
