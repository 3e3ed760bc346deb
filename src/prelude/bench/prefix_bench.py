"""`prelude bench prefix`: what prefix reuse before allocation buys, side by side.

- Judge workload: a shared 1,024-token rubric + a unique 64-token item, 1 output token,
  concurrency 16; throughput with the prefix cache vs without (two servers, same run).
- The same judge requests handed to an in-process engine in waves of 16 (no HTTP): what
  the server should reach when requests arrive one by one. Both report rows per step.
- Cold burst: 64 requests sharing a cold 1,024-token prefix sent at once; prefix tokens
  computed (from /metrics) and throughput with leader deferral vs without.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import httpx

from prelude.bench.results import write_json
from prelude.bench.server_proc import prelude_server, scrape_metrics

WORDS = ("policy rubric judge score answer evidence relevant helpful harmless accurate complete concise "
         "safety criterion document query reasoning factual grounded citation format style tone").split()


def _ids(tokenizer: Any, n: int, rng: random.Random) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out.extend(tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(64)), add_special_tokens=False))
    return out[:n]


async def _run(base: str, prompts: list[list[int]], concurrency: int) -> float:
    """Send all prompts (1 output token) with `concurrency` in flight; returns req/s."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> None:
            while not queue.empty():
                p = queue.get_nowait()
                r = await client.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 1, "temperature": 0})
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(prompts) / (time.perf_counter() - t0)


class _StepCounter:
    """An engine observer that counts steps and their computed tokens."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0

    def request_finished(self, metrics: Any) -> None:
        pass

    def step_finished(self, kind: str, seconds: float, num_tokens: int) -> None:
        self.steps += 1
        self.tokens += num_tokens


def in_process(prompts: list[list[int]], wave: int, dtype: str) -> dict[str, float]:
    """req/s and rows per step of `prompts` handed to an in-process engine `wave` at a
    time (the first prompt alone first: the rubric cached, as over HTTP)."""
    from prelude.engine.request import SamplingParams
    from prelude.entrypoints.llm import LLM

    llm = LLM(dtype=dtype, max_num_batched_tokens=8192)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts[:1], params)
    counter = _StepCounter()
    llm.engine.observer = counter
    rest = prompts[1:]
    t0 = time.perf_counter()
    for i in range(0, len(rest), wave):
        llm.generate(rest[i : i + wave], params)
    seconds = time.perf_counter() - t0
    return {"req_per_s": len(rest) / seconds, "steps": counter.steps, "tokens": counter.tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude bench prefix")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--item-tokens", type=int, default=64)
    ap.add_argument("--judge-requests", type=int, default=48)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default="bench_results/prefix.json")
    ap.add_argument("--judge-only", action="store_true", help="the judge over HTTP (cache only) and in process")
    ap.add_argument("--prelude-args", default="", help="extra `prelude serve` flags for every server")
    args = ap.parse_args(argv)
    from prelude.model.loading.files import load_model_files

    tok = load_model_files(None).tokenizer
    rng = random.Random(0)
    rubric = _ids(tok, args.prefix_tokens, rng)
    judge = [rubric + _ids(tok, args.item_tokens, rng) for _ in range(args.judge_requests)]
    cold = _ids(tok, args.prefix_tokens, rng)
    burst = [cold + _ids(tok, args.item_tokens, rng) for _ in range(args.burst)]
    common = ["--dtype", args.dtype, "--max-num-batched-tokens", "8192", *args.prelude_args.split()]
    result: dict[str, Any] = {"prefix_tokens": args.prefix_tokens, "item_tokens": args.item_tokens, "dtype": args.dtype}

    item_rows = float(args.item_tokens)
    if args.judge_only:
        with prelude_server(common) as cached:
            asyncio.run(_run(cached, judge[:1], 1))  # the rubric is cached once, as in steady state
            before = scrape_metrics(cached)
            result["judge_req_per_s_cache"] = asyncio.run(_run(cached, judge[1:], 16))
            after = scrape_metrics(cached)
    else:
        with prelude_server(common) as cached, prelude_server([*common, "--no-enable-prefix-caching"]) as uncached:
            asyncio.run(_run(cached, judge[:1], 1))  # the rubric is cached once, as in steady state
            before = scrape_metrics(cached)
            result["judge_req_per_s_cache"] = asyncio.run(_run(cached, judge[1:], 16))
            after = scrape_metrics(cached)
            result["judge_req_per_s_no_cache"] = asyncio.run(_run(uncached, judge[1:], 16))
            result["judge_cache_metrics"] = scrape_metrics(cached)
        result["judge_speedup"] = result["judge_req_per_s_cache"] / result["judge_req_per_s_no_cache"]
    steps = after["step_duration_seconds_count"] - before["step_duration_seconds_count"]
    result["judge_http_rows_per_step"] = (after["step_tokens_total"] - before["step_tokens_total"]) / item_rows / steps
    local = in_process(judge, 16, args.dtype)
    result["judge_in_process_req_per_s"] = local["req_per_s"]
    result["judge_in_process_rows_per_step"] = local["tokens"] / item_rows / local["steps"]
    print(f"judge ({args.prefix_tokens}-token rubric + {args.item_tokens}-token item, 1 out, c=16):")
    print(f"  HTTP {result['judge_req_per_s_cache']:.2f} req/s ({result['judge_http_rows_per_step']:.1f} rows a step)"
          f"   in process, waves of 16: {local['req_per_s']:.2f} req/s "
          f"({result['judge_in_process_rows_per_step']:.1f} rows a step)")
    if args.judge_only:
        write_json(args.json, result)
        return 0

    for mode, extra in (("deferral", []), ("no_deferral", ["--no-prefix-deferral"])):
        with prelude_server([*common, *extra]) as base:
            before = scrape_metrics(base)
            rps = asyncio.run(_run(base, burst, len(burst)))
            after = scrape_metrics(base)
        computed = after["prefix_cache_computed_tokens_total"] - before["prefix_cache_computed_tokens_total"]
        reused = after["prefix_cache_reused_tokens_total"] - before["prefix_cache_reused_tokens_total"]
        result[f"burst_{mode}"] = {
            "req_per_s": rps, "computed_prompt_tokens": computed, "reused_prompt_tokens": reused,
            "prefix_computations": (computed - len(burst) * args.item_tokens) / args.prefix_tokens,
            "deferred": after["prefix_cache_deferred_requests_total"],
        }

    print(f"  cache {result['judge_req_per_s_cache']:.2f} req/s   no cache {result['judge_req_per_s_no_cache']:.2f} "
          f"req/s   speedup {result['judge_speedup']:.2f}x")
    print(f"cold burst ({args.burst} requests sharing a cold {args.prefix_tokens}-token prefix):")
    for mode in ("deferral", "no_deferral"):
        b = result[f"burst_{mode}"]
        print(f"  {mode:<12} {b['req_per_s']:.2f} req/s   prefix computed {b['prefix_computations']:.2f} times   "
              f"computed {b['computed_prompt_tokens']:.0f} / reused {b['reused_prompt_tokens']:.0f} tokens")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
