"""How long one large request stalls a running stream on the event loop, with large bodies
parsed / validated / tokenized / serialized inline (`--offload off`) or off the loop (the
server's default). A measurement, not a test:

    PYTHONPATH=src python -m tests.entrypoints.loop_stall [--reps 5]

The stream is a FakeEngine completion sending a chunk every ~1 ms, driven through raw ASGI
in-process; while it runs, one large request at a time goes to the same app. Printed per
large request kind and mode: the median (over reps, modes alternating) of the longest gap
between two stream chunks during that request, and of the request's own latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any


from prelude.entrypoints.openai.api_server import build_app
from prelude.entrypoints.openai.limits import ServerLimits

from tests.entrypoints.fake_engine import FakeEngine
from tests.entrypoints.test_offload import _client, asgi_scope

MODES = {"inline": ServerLimits(offload_bytes=2**40, offload_values=2**40), "off-loop": ServerLimits()}
LARGE: dict[str, tuple[str, dict[str, Any]]] = {
    # n=2 makes it 524,288 prompt tokens: refused after parsing and validation, so the fake
    # engine's own per-token work does not count.
    "completion, 262,144 token ids x n=2 (1.9 MB, refused)": ("/v1/completions", {
        "prompt": list(range(16, 262_160)), "max_tokens": 1, "n": 2}),
    "completion, 2 MB text (tokenized, refused)": ("/v1/completions", {"prompt": "x" * 2_000_000}),
    "tokenize, 200,000 chars -> 200,000 ids answer": ("/tokenize", {"prompt": "y" * 200_000}),
}


async def _one(limits: ServerLimits, path: str, body: dict[str, Any]) -> tuple[float, float]:
    """(longest stream gap, large request latency), seconds."""
    app = build_app(FakeEngine(max_model_len=2**20, token_delay=0.001), limits=limits)
    stamps: list[float] = []
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "more_body": False, "body": json.dumps(
                {"prompt": "abc", "max_tokens": 100_000, "ignore_eos": True, "stream": True}).encode()}
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            stamps.append(time.perf_counter())

    scope = asgi_scope("/v1/completions", [(b"content-type", b"application/json")])
    stream = asyncio.ensure_future(app(scope, receive, send))
    raw = json.dumps(body).encode()
    async with _client(app) as c:
        while len(stamps) < 20:
            await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        r = await c.post(path, content=raw, headers={"content-type": "application/json"}, timeout=120)
        t1 = time.perf_counter()
        await asyncio.sleep(0.02)
    stream.cancel()
    await asyncio.gather(stream, return_exceptions=True)
    assert r.status_code < 500, r.text[:200]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b >= t0 and a <= t1]
    return max(during, default=t1 - t0), t1 - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    for name, (path, body) in LARGE.items():
        gaps: dict[str, list[float]] = {m: [] for m in MODES}
        lat: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(args.reps):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for mode in order:
                gap, latency = asyncio.run(_one(MODES[mode], path, body))
                gaps[mode].append(gap)
                lat[mode].append(latency)
        for mode in MODES:
            print(f"{name:50s} {mode:8s} longest stream gap {1e3 * statistics.median(gaps[mode]):7.1f} ms "
                  f"(runs {', '.join(f'{1e3 * g:.0f}' for g in gaps[mode])}); "
                  f"request {1e3 * statistics.median(lat[mode]):7.1f} ms")


if __name__ == "__main__":
    main()
