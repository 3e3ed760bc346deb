"""The load generator of `prelude bench overhead`, run in a process of its own so that the
client's work never shares an interpreter (or its GIL) with the benchmark driver, and
its own CPU cost is measured: the driver reads `client_cpu_s` (this process's CPU
seconds over the timed requests) next to the server's figures.

Reads one job as JSON on stdin, writes one JSON object on stdout:
  {"base", "model", "kind": completion|stream|classify|embed, "payloads": [...],
   "warmup": [...], "warmup_s": seconds of the payloads at the concurrency before timing,
   "concurrency", "max_tokens", "items": texts per payload,
   "client": raw (bench/raw_http.py, the default) | httpx}
and beside the summary "sent": every request sent, warm-ups included.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from prelude.bench.load_clients import LoadClient
from prelude.bench.loadgen import LoadSpec, Sender, run_load, summarize


def sender_for(job: dict[str, Any]) -> Sender:
    """The job's sender, on the job's client (bench/load_clients.py)."""
    base, model, kind, items = job["base"], job.get("model"), job["kind"], int(job.get("items", 1))
    client = LoadClient(job.get("client", "raw"))
    named = {"model": model} if model else {}
    if kind == "stream":
        return client.completions(base, model, int(job["max_tokens"]))
    if kind == "completion":
        max_tokens = int(job["max_tokens"])
        path, body_of = "/v1/completions", lambda p: {**named, "prompt": p, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True}
    elif kind == "classify":
        path, body_of = "/v1/classify", lambda p: {**named, "input": p, "labels": ["yes", "no"]}
    elif kind == "embed":
        path, body_of = "/v1/embeddings", lambda p: {**named, "input": p}
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return client.json(base, path, body_of, lambda _: items)


def load_spec(job: dict[str, Any]) -> LoadSpec:
    """The job's closed loop: its concurrency, its warm-up requests and seconds, its seed."""
    return LoadSpec(int(job["concurrency"]), None, warmup=len(job.get("warmup", ())), seed=int(job.get("seed", 0)),
                    warmup_s=float(job.get("warmup_s", 0.0)))


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    spec = load_spec(job)
    cpu0, t0 = time.process_time(), time.perf_counter()
    client = LoadClient(job.get("client", "raw")).pool(job["base"])
    result = asyncio.run(run_load(sender_for(job), job["payloads"], spec, warmup=job.get("warmup", ()),
                                  client=client))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    out = summarize(result, float(job.get("input_tokens", 0)))
    # The client's own cost over warm-up and timed requests together (the same per request).
    sent = len(job["payloads"]) + len(job.get("warmup", ())) + result.warmup_sent
    out["sent"] = sent
    out["client_cpu_ms_per_request"] = 1000 * cpu / max(1, sent)
    out["client_cpu_share"] = cpu / wall if wall > 0 else 0.0  # 1.0: one core busy all the time
    return out


def main() -> int:
    job = json.load(sys.stdin)
    json.dump(run_job(job), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
