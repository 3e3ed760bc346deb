"""One HTTP process (engine in-process, the default) vs `--api-server-count N`: 128-in/1-out
completions of text prompts at c=1 (E2E p50) and c=32 (req/s), on a free model so that what
is timed is the serving path. Configurations alternate round by round; medians over rounds.

    python -m benchmarks.api_servers --counts 0,1,2 --rounds 3 --out /tmp/api_servers

`0` is the default single process. The load generator is this process: raw HTTP/1.1 on
keep-alive connections (no client library), a few microseconds per request, so it is not
what saturates. Writes results.json; the load average is recorded with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prelude.bench.server_proc import free_port, server_process


def _prompts(model_dir: Path, n: int, tokens: int, seed: int) -> list[str]:
    """Distinct text prompts of about `tokens` tokens (random ids decoded: no prefix-cache hits)."""
    from prelude.tokenizer.loading import load_tokenizer

    tok = load_tokenizer(model_dir)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(1000, min(30000, tok.vocab_size)) for _ in range(tokens)]
        out.append(tok.decode(ids))
    return out


class _Conn:
    """One keep-alive HTTP/1.1 connection that posts JSON and reads the whole answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> "_Conn":
        r, w = await asyncio.open_connection(host, port)
        return cls(r, w, f"{host}:{port}")

    async def post(self, path: str, body: bytes) -> bytes:
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                          % (path.encode(), self.host.encode(), len(body)) + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        payload = await self.reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {payload[:300]!r}")
        return payload

    def close(self) -> None:
        self.writer.close()


async def _closed_loop(port: int, bodies: list[bytes], concurrency: int) -> tuple[list[float], float]:
    """Every body once, `concurrency` connections each sending back to back; latencies, wall time."""
    conns = [await _Conn.open("127.0.0.1", port) for _ in range(concurrency)]
    queue = list(reversed(bodies))
    lat: list[float] = []

    async def worker(c: _Conn) -> None:
        while queue:
            body = queue.pop()
            t0 = time.perf_counter()
            await c.post("/v1/completions", body)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - t0
    for c in conns:
        c.close()
    return lat, wall


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _run_one(count: int, model: str, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "prelude.cli", "serve", "--model", model, "--dtype", "float32", "--port", str(port),
           "--log-level", "warning", "--max-num-seqs", "64"]
    if count > 0:
        cmd += ["--api-server-count", str(count)]

    def body(p: str) -> bytes:
        return json.dumps({"prompt": p, "max_tokens": 1, "temperature": 0}).encode()

    with server_process(cmd, port, timeout_s=600):
        asyncio.run(_closed_loop(port, [body(p) for p in prompts[:64]], 8))  # warm-up, every front touched
        c1 = prompts[64:64 + args.c1_requests]
        load1 = _loadavg()
        lat, _ = asyncio.run(_closed_loop(port, [body(p) for p in c1], 1))
        c32 = prompts[64 + args.c1_requests:]
        load32 = _loadavg()
        _, wall = asyncio.run(_closed_loop(port, [body(p) for p in c32], 32))
    return {"api_server_count": count, "c1_e2e_p50_ms": 1000 * statistics.median(lat),
            "c1_e2e_p90_ms": 1000 * sorted(lat)[int(0.9 * len(lat))], "c1_loadavg": load1,
            "c32_req_s": len(c32) / wall, "c32_loadavg": load32}


def main(argv: list[str] | None = None) -> int:
    from prelude.testing.random_model import tiny_llama_dir

    p = argparse.ArgumentParser(prog="python -m benchmarks.api_servers", description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="0,1,2", help="0 = one process (the default); N = --api-server-count N")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="default: the tiny random Llama (2 layers, hidden 64, the default model's vocabulary)")
    p.add_argument("--c1-requests", type=int, default=300)
    p.add_argument("--c32-requests", type=int, default=1500)
    p.add_argument("--out", default="bench_results/api_servers")
    args = p.parse_args(argv)
    model = args.model or str(tiny_llama_dir())
    prompts = _prompts(Path(model), 64 + args.c1_requests + args.c32_requests, 128, seed=0)
    counts = [int(c) for c in args.counts.split(",")]
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for count in counts:  # alternated: slow drifts of the shared machine hit every config alike
            run = _run_one(count, model, prompts, args) | {"round": r}
            runs.append(run)
            print(json.dumps(run), flush=True)
    summary = {}
    for count in counts:
        mine = [x for x in runs if x["api_server_count"] == count]
        summary[str(count)] = {"c1_e2e_p50_ms": statistics.median(x["c1_e2e_p50_ms"] for x in mine),
                               "c32_req_s": statistics.median(x["c32_req_s"] for x in mine)}
    print(json.dumps({"model": model, "summary": summary}, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"model": model, "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
