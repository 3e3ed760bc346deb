"""The load generator of `prelude bench overhead`, run in a process of its own so that the
client's work never shares an interpreter (or its GIL) with the benchmark driver, and
its own CPU cost is measured: the driver reads `client_cpu_s` (this process's CPU
seconds over the timed requests) next to the server's figures.

Reads one job as JSON on stdin, writes one JSON object on stdout:
  {"base", "model", "kind": completion|stream|classify|embed, "payloads": [...],
   "warmup": [...], "concurrency", "max_tokens", "items": texts per payload,
   "client": raw (bench/raw_http.py, the default) | httpx}
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from prelude.bench.loadgen import LoadSpec, Sender, completion_sender, json_sender, run_load, summarize
from prelude.bench.raw_http import RawPool, raw_completion_sender, raw_json_sender


def sender_for(job: dict[str, Any]) -> Sender:
    """The job's sender: over bench/raw_http.py's RawPool (client "raw", the default), or
    an httpx client ("httpx", what earlier figures were measured with)."""
    base, model, kind, items = job["base"], job.get("model"), job["kind"], int(job.get("items", 1))
    raw = job.get("client", "raw") == "raw"
    named = {"model": model} if model else {}
    if kind == "stream":
        return raw_completion_sender(model, int(job["max_tokens"])) if raw else \
            completion_sender(base, model, int(job["max_tokens"]))
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
    return raw_json_sender(path, body_of, lambda _: items) if raw else json_sender(base, path, body_of, lambda _: items)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    spec = LoadSpec(int(job["concurrency"]), None, len(job.get("warmup", ())), int(job.get("seed", 0)))
    cpu0, t0 = time.process_time(), time.perf_counter()
    client = RawPool(job["base"]) if job.get("client", "raw") == "raw" else None
    result = asyncio.run(run_load(sender_for(job), job["payloads"], spec, warmup=job.get("warmup", ()),
                                  client=client))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    out = summarize(result, float(job.get("input_tokens", 0)))
    # The client's own cost over warm-up and timed requests together (the same per request).
    sent = len(job["payloads"]) + len(job.get("warmup", ()))
    out["client_cpu_ms_per_request"] = 1000 * cpu / max(1, sent)
    out["client_cpu_share"] = cpu / wall if wall > 0 else 0.0  # 1.0: one core busy all the time
    return out


def main() -> int:
    job = json.load(sys.stdin)
    json.dump(run_job(job), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
