"""One prompt through the engine in-process (no server), on CUDA: the median time of
add_request + steps until its one output token, a fresh prompt each time (no prefix hit),
beside the forward alone. `python3 scripts/gpu/engine_step.py [SHAPE] [TOKENS] [--profile]`;
put another checkout's src first on PYTHONPATH for old vs new."""
import cProfile
import pstats
import statistics
import sys
import time

import torch

from prelude.testing.random_model import random_model_dir
from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
from prelude.engine.engine import LLMEngine
from prelude.forward_batch import OneShotBatch, OneShotRow
from prelude.params import SamplingParams

args = [a for a in sys.argv[1:] if not a.startswith("--")]
shape = args[0] if args else "qwen3-0.6b"
tokens = int(args[1]) if len(args) > 1 else 512
engine = LLMEngine.from_config(EngineConfig(
    model=str(random_model_dir(shape)), executor=ExecutorConfig(device="cuda"),
    cache=CacheConfig(kv_cache_memory_gib=8.0), scheduler=SchedulerConfig(max_model_len=2048)))
gen = torch.Generator().manual_seed(0)
counter = iter(range(10**6))


def prompt() -> list[int]:
    return torch.randint(10, 100000, (tokens,), generator=gen).tolist()


def one() -> None:
    ids = prompt()
    engine.add_request(f"r{next(counter)}", ids, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()


def forward() -> None:
    hidden, _ = engine.runner.trunk(OneShotBatch((OneShotRow("f", prompt(), None, None),)))[:2]
    engine.runner.model.compute_logits(hidden[-1:]).argmax(-1).cpu()


for name, f in (("engine add+steps", one), ("forward+logits", forward)):
    for _ in range(5):
        f()
    times = []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        times.append(1000 * (time.perf_counter() - t0))
    print(f"{shape} {tokens} tokens, {name}: p50 {statistics.median(times):.2f} ms "
          f"(min {min(times):.2f}), overlap {engine.overlap}", flush=True)
if "--profile" in sys.argv:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        one()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
