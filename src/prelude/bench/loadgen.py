"""An async load generator for OpenAI-compatible servers.

Closed loop (a fixed number of requests in flight) or open loop (Poisson arrivals at a
rate, optionally capped in flight), warm-up requests outside the measurement, a fixed
seed for arrival times, streaming TTFT, and a progress bar. A failed request is kept as
a failed record (counted and reported), never dropped or retried.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
from tqdm import tqdm


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int  # most requests in flight (closed loop: always this many)
    rate: float | None = None  # Poisson arrivals per second; None = closed loop
    warmup: int = 1  # requests sent and discarded before timing starts
    seed: int = 0
    progress: str | None = None  # progress bar label; None hides the bar
    # after `warmup`, for this long, the payloads in a closed loop at `concurrency`, discarded:
    # the server settles into the load (a thread count chosen per window of load, caches)
    warmup_s: float = 0.0


@dataclass(frozen=True)
class Record:
    ok: bool
    e2e_s: float
    ttft_s: float
    output_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried text (TPOT needs more than one)
    items: int = 1  # texts in a pooling request, 1 otherwise
    error: str = ""
    queued_s: float = 0.0  # open loop: scheduled arrival -> sent (client-side queueing), inside e2e/ttft


@dataclass(frozen=True)
class LoadResult:
    records: list[Record]
    wall_s: float
    warmup_sent: int = 0  # requests of the timed warm-up (LoadSpec.warmup_s)


Sender = Callable[[httpx.AsyncClient, Any], Awaitable[Record]]


@dataclass
class StreamTally:
    """What a /v1/completions event stream said so far, line by line (both HTTP clients)."""

    t0: float
    first: float | None = None  # when the first event carrying text came
    chunks: int = 0  # events that carried text
    usage_tokens: int | None = None
    done: bool = False  # `data: [DONE]` seen

    def line(self, line: str) -> str | None:
        """Take one line of the stream; an in-band error event's text, else None."""
        if line == "data: [DONE]":
            self.done = True
            return None
        if not line.startswith("data: "):
            return None
        event = json.loads(line[6:])
        if "error" in event:
            return str(event["error"])[:200]
        if any(c.get("text") for c in event.get("choices") or []):
            self.chunks += 1
            if self.first is None:
                self.first = time.perf_counter()
        if event.get("usage"):
            self.usage_tokens = event["usage"].get("completion_tokens")
        return None

    def record(self) -> Record:
        """The finished stream's record; one without `data: [DONE]` is a failure (a cut
        connection must not pass for a fast answer)."""
        end = time.perf_counter()
        if not self.done:
            return Record(False, end - self.t0, 0.0, error="stream ended before [DONE]")
        tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        return Record(True, end - self.t0, (self.first or end) - self.t0, tokens, self.chunks)


def completion_sender(base: str, model: str | None, max_tokens: int) -> Sender:
    """Streams /v1/completions for a text prompt; TTFT is the first chunk carrying text.
    Output tokens come from the stream's usage when the server sends it, else one per
    text chunk. A stream that ends before `data: [DONE]` is a failure (a cut connection
    must not pass for a fast answer)."""

    async def send(client: httpx.AsyncClient, prompt: str) -> Record:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
        tally = StreamTally(time.perf_counter())
        try:
            async with client.stream("POST", base + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return Record(False, time.perf_counter() - tally.t0, 0.0, error=f"HTTP {r.status_code}: {r.text[:200]}")
                async for line in r.aiter_lines():
                    error = tally.line(line)
                    if error is not None:
                        return Record(False, time.perf_counter() - tally.t0, 0.0, error=error)
        except httpx.HTTPError as exc:
            return Record(False, time.perf_counter() - tally.t0, 0.0, error=f"{type(exc).__name__}: {exc}")
        return tally.record()

    return send


def json_sender(base: str, path: str, body_of: Callable[[Any], dict[str, Any]], items_of: Callable[[Any], int]) -> Sender:
    """POSTs a non-streaming JSON request (embeddings, classify); TTFT = E2E."""

    async def send(client: httpx.AsyncClient, payload: Any) -> Record:
        t0 = time.perf_counter()
        try:
            r = await client.post(base + path, json=body_of(payload))
        except httpx.HTTPError as exc:
            return Record(False, time.perf_counter() - t0, 0.0, error=f"{type(exc).__name__}: {exc}")
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            return Record(False, dt, 0.0, error=f"HTTP {r.status_code}: {r.text[:200]}")
        return Record(True, dt, dt, items=items_of(payload))

    return send


async def run_load(
    send: Sender, payloads: Sequence[Any], spec: LoadSpec, warmup: Sequence[Any] = (),
    transport: httpx.AsyncBaseTransport | None = None, client: Any = None,
) -> LoadResult:
    """Sends every payload once under `spec`; the clock starts after the warm-up.
    Open loop: a request's latency counts from its scheduled arrival, so time spent
    waiting for a free slot in the client (the concurrency cap) is not hidden. A sender
    that raises records a failure; the run goes on. `transport` replaces the network (tests);
    `client`: an async context manager the senders take instead of an httpx client
    (bench/raw_http.py's RawPool)."""
    limits = httpx.Limits(max_connections=spec.concurrency + 4, max_keepalive_connections=spec.concurrency + 4)
    if client is None:
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits, transport=transport)
    async with client:
        for payload in list(warmup)[: spec.warmup]:
            await send(client, payload)
        warmup_sent = await _keep_busy(send, client, payloads, spec.concurrency, spec.warmup_s)
        bar = tqdm(total=len(payloads), desc=spec.progress, disable=spec.progress is None, file=sys.stderr,
                   leave=False, dynamic_ncols=True)
        records: list[Record] = []

        async def one(payload: Any, scheduled: float | None = None) -> None:
            start = time.perf_counter()
            try:
                rec = await send(client, payload)
            except Exception as exc:  # noqa: BLE001 - one bad request must not abort the whole run
                rec = Record(False, time.perf_counter() - start, 0.0, error=f"{type(exc).__name__}: {exc}"[:200])
            if scheduled is not None:
                wait = start - scheduled
                rec = replace(rec, e2e_s=rec.e2e_s + wait, ttft_s=rec.ttft_s + wait if rec.ok else 0.0, queued_s=wait)
            records.append(rec)
            bar.update(1)
            if not rec.ok:
                bar.set_postfix(errors=sum(not r.ok for r in records))

        t0 = time.perf_counter()
        if spec.rate is None:
            queue: asyncio.Queue[Any] = asyncio.Queue()
            for p in payloads:
                queue.put_nowait(p)

            async def worker() -> None:
                while not queue.empty():
                    await one(queue.get_nowait())

            await asyncio.gather(*(worker() for _ in range(min(spec.concurrency, len(payloads)))))
        else:
            rng = random.Random(spec.seed)
            gate = asyncio.Semaphore(spec.concurrency)

            async def gated(payload: Any, scheduled: float) -> None:
                async with gate:
                    await one(payload, scheduled)

            tasks = []
            next_arrival = t0
            for p in payloads:
                tasks.append(asyncio.create_task(gated(p, next_arrival)))
                next_arrival += rng.expovariate(spec.rate)
                # Sleep to the schedule, not for a gap: event-loop lateness does not accumulate.
                await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        bar.close()
        return LoadResult(records, wall, warmup_sent)


async def _keep_busy(send: Sender, client: Any, payloads: Sequence[Any], concurrency: int, seconds: float) -> int:
    """The payloads, round and round, `concurrency` at a time, until `seconds` have passed
    (each loop slot sends at least once; a request under way then is finished); how many
    were sent. Failures are not counted apart."""
    if seconds <= 0 or not payloads:
        return 0
    end = time.perf_counter() + seconds
    sent = 0

    async def worker(first: int) -> None:
        nonlocal sent
        i = first
        while True:
            sent += 1
            try:
                await send(client, payloads[i % len(payloads)])
            except Exception:  # noqa: BLE001 - a warm-up failure shows again in the timed run
                pass
            i += concurrency
            if time.perf_counter() >= end:
                return

    await asyncio.gather(*(worker(k) for k in range(max(1, concurrency))))
    return sent


def percentile(xs: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile; NaN for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(result: LoadResult, input_tokens: float) -> dict[str, Any]:
    """Per-run figures: rates over the wall clock of the run, latencies over successes.
    `input_tokens` is the mean prompt length of the payloads."""
    ok = [r for r in result.records if r.ok]
    wall = result.wall_s
    e2e = [r.e2e_s for r in ok]
    ttft = [r.ttft_s for r in ok]
    # A server that sends all text in one chunk has no measurable time per output token.
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.chunks > 1]
    out = {
        "requests": len(result.records),
        "errors": len(result.records) - len(ok),
        "wall_s": wall,
        "req_s": len(ok) / wall,
        "rpm": 60 * len(ok) / wall,
        "items_s": sum(r.items for r in ok) / wall,
        "input_tok_s": input_tokens * len(ok) / wall,
        "output_tok_s": sum(r.output_tokens for r in ok) / wall,
        "mean_output_tokens": statistics.fmean([r.output_tokens for r in ok]) if ok else math.nan,
        "e2e_p50_ms": 1000 * percentile(e2e, 50),
        "e2e_p95_ms": 1000 * percentile(e2e, 95),
        "e2e_mean_ms": 1000 * statistics.fmean(e2e) if e2e else math.nan,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p95_ms": 1000 * percentile(ttft, 95),
        "tpot_p50_ms": 1000 * percentile(tpot, 50),
        "tpot_p95_ms": 1000 * percentile(tpot, 95),
        "queued_p50_ms": 1000 * percentile([r.queued_s for r in ok], 50),
    }
    errors = [r.error for r in result.records if not r.ok]
    if errors:
        out["first_error"] = errors[0]
    return out
