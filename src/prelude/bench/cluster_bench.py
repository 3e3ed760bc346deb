"""`prelude bench cluster`: replicas on Ray, shared-prefix preset (`--preset mixed`:
prefill/decode disaggregation vs colocation, see disagg_bench.py).

K shared system prompts, each used by R requests (a unique suffix each, a few output
tokens), sent with concurrency C in a shuffled order, against:
- 1 replica x 2 torch threads (the single-engine reference, also through Ray),
- 2 replicas x 1 thread, round-robin routing,
- 2 replicas x 1 thread, prefix routing.
Fresh replicas (cold caches) for every configuration; configurations alternate over
`--rounds`; medians are reported. Prefix hit rate = reused / (reused + computed)
prompt tokens, summed over replicas. On a 2-core machine the replicas share the
cores: this compares the same cores split two ways (per core), not scaling.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from prelude.bench.results import write_json

CONFIGS = {  # name -> (replicas, threads per replica, router)
    "1x2 (single engine)": (1, 2, "round_robin"),
    "2x1 round_robin": (2, 1, "round_robin"),
    "2x1 prefix": (2, 1, "prefix"),
}


async def _drive(client: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    from prelude.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)

    async def worker() -> None:
        while not queue.empty():
            i, p = queue.get_nowait()
            async for _ in client.generate(f"bench-{i}", p, params):
                pass

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="shared-prefix", choices=["shared-prefix", "mixed"])
    known, _ = pre.parse_known_args(argv)
    if known.preset == "mixed":
        from prelude.bench.disagg_bench import main as mixed_main

        return mixed_main(argv)
    ap = argparse.ArgumentParser(prog="prelude bench cluster", description=__doc__, parents=[pre],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefixes", type=int, default=8, help="K shared system prompts")
    ap.add_argument("--uses", type=int, default=4, help="R requests per system prompt")
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_results/cluster.json")
    args = ap.parse_args(argv)

    import ray

    from prelude.cluster.launch import ClusterConfig, engine_factory, ensure_ray, start_client, tokenizer_factory
    from prelude.cluster.router import RouterConfig
    from prelude.config import EngineConfig, ExecutorConfig, SchedulerConfig

    config = EngineConfig(model=args.model, executor=ExecutorConfig(device="cpu", dtype=args.dtype), seed=args.seed,
                          scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    ensure_ray(None, 2)
    rng = random.Random(args.seed)
    vocab_lo, vocab_hi = 100, 20000  # plain ids, no special tokens
    prefixes = [[rng.randrange(vocab_lo, vocab_hi) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    prompts = [p + [rng.randrange(vocab_lo, vocab_hi) for _ in range(args.suffix_tokens)]
               for p in prefixes for _ in range(args.uses)]
    rng.shuffle(prompts)

    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    for rnd in range(args.rounds):
        names = list(CONFIGS) if rnd % 2 == 0 else list(reversed(CONFIGS))
        for name in names:
            n, threads, router = CONFIGS[name]
            cluster = ClusterConfig(num_replicas=n, replica_threads=threads,
                                    router=RouterConfig(policy=router, block_size=config.cache.block_size))
            client = start_client(engine_factory(config), cluster, seed=args.seed,
                                  tokenizer_factory=tokenizer_factory(config))
            try:
                seconds = asyncio.run(_drive(client, prompts, args.concurrency, args.max_tokens))
                m = client.metrics()
            finally:
                client.shutdown()
            row = {"seconds": seconds, "req_s": len(prompts) / seconds, "hit_rate": m["prefix_cache_hit_rate"]}
            results[name].append(row)
            print(f"round {rnd}: {name}: {row['req_s']:.3f} req/s, prefix hit rate {row['hit_rate']:.3f}", flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rows) for k in ("req_s", "hit_rate")}
               for name, rows in results.items()}
    single = summary["1x2 (single engine)"]["hit_rate"]
    print("\nconfig | req/s (median) | prefix hit rate | hit rate / single engine's")
    for name, s in summary.items():
        print(f"{name} | {s['req_s']:.3f} | {s['hit_rate']:.3f} | {s['hit_rate'] / single if single else 0:.2f}")
    write_json(args.json, {"args": vars(args), "rounds": results, "median": summary})
    ray.shutdown()
    return 0
