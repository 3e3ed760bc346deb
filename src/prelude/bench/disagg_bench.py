"""`prelude bench cluster --preset mixed`: prefill/decode disaggregation vs colocation.

A mixed workload (Poisson arrivals; most requests short prompts with longer outputs,
some long prompts with short outputs) replayed against, on the same cores:
- colocated: 2 replicas x 1 torch thread, least-load routing, each replica prefills and
  decodes (policy `--colocated-policy`);
- disaggregated 1:1: 1 prefill replica (SRPT) and 1 decode replica (MLFQ), 1 thread each,
  the KV handed over through Ray's object store, `--max-requests-in-scheduler` cap.
Fresh replicas for every run; configurations alternate over `--rounds`; medians of the
per-round figures are reported. Times are taken by the client (the bench process, the
same front code the server runs): TTFT = arrival to first token; TPOT of a request =
(last token - first token) / (tokens - 1); P99 over all requests, TTFT P90 over the short
ones. Throughput = output tokens / (last finish - first arrival): at an offered load
both configurations sustain, equal throughput is the point of comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from prelude.bench.results import write_json


@dataclass(frozen=True)
class Job:
    arrival: float
    prompt: list[int]
    max_tokens: int
    long: bool


@dataclass(frozen=True)
class Done:
    job: Job
    ttft: float
    tpot: float | None
    tokens: int
    finish: float
    second_gap: float | None  # first -> second token: the hand-off, when disaggregated


def mixed_trace(n: int, rate: float, seed: int, short_len: tuple[int, int], long_len: int, long_fraction: float,
                short_out: int, long_out: int) -> list[Job]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < long_fraction
        length = long_len if long else rng.randint(*short_len)
        jobs.append(Job(t, [rng.randrange(100, 20000) for _ in range(length)], long_out if long else short_out, long))
    return jobs


async def replay(client: Any, jobs: list[Job]) -> tuple[list[Done], float]:
    from prelude.engine.request import SamplingParams

    t0 = time.perf_counter()

    async def one(i: int, job: Job) -> Done:
        await asyncio.sleep(max(0.0, t0 + job.arrival - time.perf_counter()))
        start = time.perf_counter()
        params = SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True)
        stamps: list[float] = []
        async for out in client.generate(f"mixed-{i}", job.prompt, params):
            stamps.extend([time.perf_counter()] * len(out.new_token_ids))
        tokens = len(stamps)
        assert tokens == job.max_tokens
        first, last = stamps[0], stamps[-1]
        tpot = (last - first) / (tokens - 1) if tokens > 1 else None
        return Done(job, first - start, tpot, tokens, last - t0, stamps[1] - first if tokens > 1 else None)

    done = await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs)))
    return list(done), max(d.finish for d in done) - jobs[0].arrival


def summarize(done: list[Done], span: float) -> dict[str, float]:
    tpots = [d.tpot for d in done if d.tpot is not None]
    short_ttft = [d.ttft for d in done if not d.job.long]
    return {
        "tpot_p50_s": float(np.percentile(tpots, 50)), "tpot_p99_s": float(np.percentile(tpots, 99)),
        "short_ttft_p90_s": float(np.percentile(short_ttft, 90)),
        "second_token_gap_p50_s": float(np.percentile([d.second_gap for d in done if d.second_gap is not None], 50)),
        "ttft_p90_s": float(np.percentile([d.ttft for d in done], 90)),
        "throughput_tok_s": sum(d.tokens for d in done) / span, "req_s": len(done) / span,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude bench cluster --preset mixed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mixed")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.4, help="offered load, requests per second (Poisson)")
    ap.add_argument("--short-len", default="32:96", help="short prompt tokens, min:max")
    ap.add_argument("--long-len", type=int, default=384)
    ap.add_argument("--long-fraction", type=float, default=0.2)
    ap.add_argument("--short-out", type=int, default=32)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-requests-in-scheduler", type=int, default=64)
    ap.add_argument("--colocated-policy", default="srpt+mlfq")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_results/cluster_mixed.json")
    args = ap.parse_args(argv)

    import ray

    from prelude.cluster.launch import ClusterConfig, engine_factory, ensure_ray, start_client, tokenizer_factory
    from prelude.cluster.router import RouterConfig
    from prelude.config import EngineConfig, ExecutorConfig, SchedulerConfig

    def config(policy: str) -> EngineConfig:
        return EngineConfig(model=args.model, executor=ExecutorConfig(device="cpu", dtype=args.dtype), seed=args.seed,
                            scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                                      policy=policy))

    lo, hi = (int(v) for v in args.short_len.split(":"))
    jobs = mixed_trace(args.requests, args.rate, args.seed, (lo, hi), args.long_len, args.long_fraction,
                       args.short_out, args.long_out)
    ensure_ray(None, 2)
    names = ["colocated 2x1 (least_load)", "disaggregated 1P:1D"]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else list(reversed(names))):
            router = RouterConfig(policy="least_load")
            if name.startswith("colocated"):
                cluster = ClusterConfig(num_replicas=2, replica_threads=1, router=router)
                client = start_client(engine_factory(config(args.colocated_policy)), cluster, seed=args.seed,
                                      tokenizer_factory=tokenizer_factory(config("fcfs")))
            else:
                cluster = ClusterConfig(num_replicas=2, replica_threads=1, router=router, disaggregate=(1, 1),
                                        max_requests_in_scheduler=args.max_requests_in_scheduler)
                client = start_client(engine_factory(config("srpt")), cluster, seed=args.seed,
                                      tokenizer_factory=tokenizer_factory(config("fcfs")),
                                      decode_factory=engine_factory(config("mlfq")))
            try:
                done, span = asyncio.run(replay(client, jobs))
                row = summarize(done, span)
                if name.startswith("disaggregated"):
                    m = client.metrics()
                    row["handoffs"] = m["cluster_handoffs_total"]
                    row["handoff_waits"] = m["cluster_handoff_waits_total"]
                client.check_integrity()
            finally:
                client.shutdown()
            results[name].append(row)
            print(f"round {rnd}: {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    keys = ["tpot_p50_s", "tpot_p99_s", "short_ttft_p90_s", "ttft_p90_s", "second_token_gap_p50_s",
            "throughput_tok_s", "req_s"]
    summary = {name: {k: statistics.median(r[k] for r in rows) for k in keys} for name, rows in results.items()}
    co, dis = summary[names[0]], summary[names[1]]
    print("\nconfig (same 2 cores) | TPOT p50 s | TPOT p99 s | short TTFT p90 s | TTFT p90 s | 1st->2nd token p50 s | "
          "output tok/s | req/s")
    for name, s in summary.items():
        print(f"{name} | " + " | ".join(f"{s[k]:.3f}" for k in keys))
    ratio = co["tpot_p99_s"] / dis["tpot_p99_s"] if dis["tpot_p99_s"] else float("nan")
    print(f"P99 TPOT colocated / disaggregated: {ratio:.2f}x (goal >= 2x at equal throughput: "
          f"{dis['throughput_tok_s']:.2f} vs {co['throughput_tok_s']:.2f} tok/s)")
    write_json(args.json, {"args": vars(args), "rounds": results, "median": summary, "p99_tpot_ratio": ratio})
    ray.shutdown()
    return 0
