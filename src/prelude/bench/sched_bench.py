"""`prelude bench sched`: policies against head-of-line blocking, side by side.

Poisson arrivals mixing long (1K-2K tokens) and short (< 64 tokens) prompts, the same
seeded schedule for every policy and rate; each policy gets its own server, run one
after the other with identical budgets. Client-side streaming TTFT, TPOT and JCT;
TTFT targets are sent per request (`ttft_slo_ms`) so deadline-aware policies see them.
Prints a markdown table, writes JSON (and a PNG when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from prelude.bench.results import write_json
from prelude.bench.server_proc import prelude_server


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt: list[int]
    max_tokens: int
    long: bool
    slo_ms: float


@dataclass
class Sample:
    long: bool
    prompt_tokens: int
    output_tokens: int
    ttft: float
    tpot: float | None
    jct: float
    slo_ms: float


def workload(n: int, rate: float, long_frac: float, seed: int, vocab: int) -> list[Arrival]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < long_frac
        length = rng.randint(1024, 2048) if long else rng.randint(8, 63)
        # Output lengths vary independently of prompt length (JCT is sliced by them).
        max_tokens = rng.choice([4, 8, 16, 32, 64, 96])
        prompt = [rng.randrange(100, vocab - 100) for _ in range(length)]
        slo = 2.0 * length + 400.0  # a TTFT target that grows with the prompt
        out.append(Arrival(t, prompt, max_tokens, long, slo))
    return out


async def one(client: httpx.AsyncClient, base: str, a: Arrival, t0: float) -> Sample:
    await asyncio.sleep(max(0.0, t0 + a.at - time.perf_counter()))
    start = time.perf_counter()
    body = {"prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "ttft_slo_ms": a.slo_ms}
    first = None
    tokens = 0
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                tokens += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    ttft = (first or end) - start
    tpot = (end - first) / (a.max_tokens - 1) if first is not None and a.max_tokens > 1 else None
    return Sample(a.long, len(a.prompt), a.max_tokens, ttft, tpot, end - start, a.slo_ms)


async def drive(base: str, arrivals: list[Arrival]) -> tuple[list[Sample], float]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=512)) as client:
        await client.post(base + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        samples = await asyncio.gather(*(one(client, base, a, t0) for a in arrivals))
        return list(samples), time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summarize(samples: list[Sample], wall: float) -> dict[str, Any]:
    short = [s.ttft for s in samples if not s.long]
    long = [s.ttft for s in samples if s.long]
    by_out = sorted(samples, key=lambda s: s.output_tokens)
    k30, k10 = max(1, int(0.3 * len(by_out))), max(1, int(0.1 * len(by_out)))
    tpots = [s.tpot for s in samples if s.tpot is not None]
    return {
        "requests": len(samples),
        "throughput_req_s": len(samples) / wall,
        "short_ttft_s": {f"p{p}": pct(short, p) for p in (50, 90, 99)},
        "long_ttft_s": {f"p{p}": pct(long, p) for p in (50, 90, 99)},
        "tpot_s": {f"p{p}": pct(tpots, p) for p in (50, 90, 99)},
        "slo_violation_rate": sum(s.ttft * 1000 > s.slo_ms for s in samples) / len(samples),
        "jct_bottom30_by_output_s": {f"p{p}": pct([s.jct for s in by_out[:k30]], p) for p in (50, 99)},
        "jct_top10_by_output_s": {f"p{p}": pct([s.jct for s in by_out[-k10:]], p) for p in (50, 99)},
    }


def _fmt(x: float | None, scale: float = 1000.0) -> str:
    return "-" if x is None else f"{x * scale:.0f}"


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| rate | policy | req/s | short TTFT p50/p90/p99 ms | long TTFT p50/p90/p99 ms | TPOT p50/p99 ms "
             "| SLO viol. | JCT bottom30% p50/p99 ms | JCT top10% p50/p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rate, by_policy in results.items():
        for policy, r in by_policy.items():
            st, lt, tp = r["short_ttft_s"], r["long_ttft_s"], r["tpot_s"]
            jb, jt = r["jct_bottom30_by_output_s"], r["jct_top10_by_output_s"]
            lines.append(
                f"| {rate} | {policy} | {r['throughput_req_s']:.2f} | {_fmt(st['p50'])}/{_fmt(st['p90'])}/{_fmt(st['p99'])} "
                f"| {_fmt(lt['p50'])}/{_fmt(lt['p90'])}/{_fmt(lt['p99'])} | {_fmt(tp['p50'])}/{_fmt(tp['p99'])} "
                f"| {100 * r['slo_violation_rate']:.0f}% | {_fmt(jb['p50'])}/{_fmt(jb['p99'])} | {_fmt(jt['p50'])}/{_fmt(jt['p99'])} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    rates = list(results)
    for policy in next(iter(results.values())):
        ax.plot(rates, [1000 * (results[r][policy]["short_ttft_s"]["p90"] or 0) for r in rates], marker="o", label=policy)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("short-request P90 TTFT (ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude bench sched")
    ap.add_argument("--policies", default="fcfs,srpt+mlfq,laps")
    ap.add_argument("--rates", default="0.5,1.0")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--long-frac", type=float, default=0.2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-decode-batch", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_results/sched.json")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for rate in rates:
        arrivals = workload(args.requests, rate, args.long_frac, args.seed, vocab=49152)
        results[str(rate)] = {}
        for policy in args.policies.split(","):
            server_args = ["--dtype", args.dtype, "--policy", policy, "--no-enable-prefix-caching",
                           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                           "--max-decode-batch", str(args.max_decode_batch), "--max-num-seqs", "32"]
            with prelude_server(server_args) as base:
                samples, wall = asyncio.run(drive(base, arrivals))
            results[str(rate)][policy] = summarize(samples, wall)
            print(f"rate {rate} {policy}: {json.dumps(results[str(rate)][policy]['short_ttft_s'])}", flush=True)
    md = table(results)
    print(md)
    path = write_json(args.json, {"config": vars(args), "results": results})
    path.with_suffix(".md").write_text(md + "\n")
    if plot(results, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
