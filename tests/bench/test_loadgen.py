"""The load generator against an in-process fake server (httpx MockTransport)."""

import asyncio
import json
import math

import httpx
import pytest

from prelude.bench.loadgen import (
    LoadResult,
    LoadSpec,
    Record,
    completion_sender,
    json_sender,
    percentile,
    run_load,
    summarize,
)


class FakeServer:
    """Streams `tokens` text chunks per completion, then a usage chunk; counts how many
    requests are in flight at once. Prompts starting with "fail" get HTTP 500."""

    def __init__(self, tokens: int = 3, delay: float = 0.005, usage: bool = True, done: bool = True) -> None:
        self.tokens, self.delay, self.usage, self.done = tokens, delay, usage, done
        self.in_flight = 0
        self.most_in_flight = 0
        # Set: measured requests (not warm-ups) wait until this many are in flight at once,
        # so a closed loop's full concurrency shows on any machine (then they stop waiting).
        self.hold_until_in_flight: int | None = None
        self._all_in = asyncio.Event()
        self.bodies: list[dict] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold_until_in_flight is not None and str(body.get("prompt", "")).startswith("p"):
                if self.in_flight >= self.hold_until_in_flight:
                    self._all_in.set()
                await asyncio.wait_for(self._all_in.wait(), 60)
            await asyncio.sleep(self.delay)
            text = body.get("prompt") or body.get("input")
            if isinstance(text, str) and text.startswith("fail"):
                return httpx.Response(500, json={"error": {"message": "boom"}})
            if request.url.path != "/v1/completions":
                return httpx.Response(200, json={"data": [{"index": i} for i in range(len(body["input"]))]})
            events = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(self.tokens)]
            if self.usage:
                events.append({"choices": [], "usage": {"completion_tokens": self.tokens}})
            sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if self.done else "")
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        finally:
            self.in_flight -= 1


def _run(server: FakeServer, payloads: list, spec: LoadSpec, max_tokens: int = 3, warmup: list | None = None) -> LoadResult:
    send = completion_sender("http://fake", "m", max_tokens)
    return asyncio.run(run_load(send, payloads, spec, warmup or [], transport=httpx.MockTransport(server.handle)))


def test_closed_loop_keeps_exactly_the_concurrency_in_flight_and_counts_tokens() -> None:
    server = FakeServer(tokens=4)
    server.hold_until_in_flight = 6
    res = _run(server, [f"p{i}" for i in range(24)], LoadSpec(concurrency=6, warmup=2), max_tokens=4, warmup=["w"] * 5)
    assert len(res.records) == 24 and all(r.ok for r in res.records)
    assert server.most_in_flight == 6
    # Two warm-up requests (not five: spec.warmup bounds them), sent before the clock and not recorded.
    assert len(server.bodies) == 26 and [b["prompt"] for b in server.bodies[:2]] == ["w", "w"]
    assert all(r.output_tokens == 4 and r.chunks == 4 and 0 < r.ttft_s <= r.e2e_s for r in res.records)
    body = server.bodies[-1]
    assert body["stream"] and body["max_tokens"] == 4 and body["model"] == "m" and body["temperature"] == 0


def test_a_timed_warm_up_runs_the_payloads_at_the_concurrency_then_the_clock_starts() -> None:
    """warmup_s: the payloads round and round, `concurrency` in flight, none recorded; then
    every payload once, timed. The warm-up's count comes back (per-request CPU figures)."""
    server = FakeServer(tokens=1, delay=0.005)
    server.hold_until_in_flight = 3  # the warm-up's own requests fill the loop too
    payloads = [f"p{i}" for i in range(5)]
    res = _run(server, payloads, LoadSpec(concurrency=3, warmup=0, warmup_s=0.1), max_tokens=1)
    assert len(res.records) == 5 and all(r.ok for r in res.records)
    assert res.warmup_sent >= 3 and len(server.bodies) == res.warmup_sent + 5
    assert server.most_in_flight == 3
    # the warm-up sends the payloads (each loop slot at least once), the timed run each once
    warm = [b["prompt"] for b in server.bodies[: res.warmup_sent]]
    timed = [b["prompt"] for b in server.bodies[res.warmup_sent:]]
    assert set(warm) <= set(payloads) and sorted(timed) == payloads
    assert _run(FakeServer(), ["a"], LoadSpec(concurrency=1, warmup=0)).warmup_sent == 0


def test_poisson_arrivals_respect_the_in_flight_cap_and_finish_every_request() -> None:
    server = FakeServer(delay=0.02)
    res = _run(server, [f"p{i}" for i in range(30)], LoadSpec(concurrency=3, rate=500.0, warmup=0, seed=7))
    assert len(res.records) == 30 and all(r.ok for r in res.records)
    assert server.most_in_flight <= 3


def test_failures_are_recorded_not_dropped() -> None:
    server = FakeServer()
    res = _run(server, ["ok1", "fail-this", "ok2"], LoadSpec(concurrency=1, warmup=0))
    assert [r.ok for r in res.records].count(False) == 1
    summary = summarize(res, input_tokens=10)
    assert summary["requests"] == 3 and summary["errors"] == 1
    assert "HTTP 500" in summary["first_error"]


def test_output_tokens_fall_back_to_chunks_without_usage() -> None:
    res = _run(FakeServer(tokens=5, usage=False), ["a", "b"], LoadSpec(concurrency=2, warmup=0), max_tokens=5)
    assert [r.output_tokens for r in res.records] == [5, 5]


def test_json_sender_counts_items() -> None:
    server = FakeServer()
    send = json_sender("http://fake", "/v1/embeddings", lambda texts: {"input": texts}, len)
    res = asyncio.run(run_load(send, [["a", "b", "c"], ["d"]], LoadSpec(concurrency=2, warmup=0),
                               transport=httpx.MockTransport(server.handle)))
    assert sorted(r.items for r in res.records) == [1, 3]
    assert all(r.ttft_s == r.e2e_s for r in res.records)


def test_summary_figures() -> None:
    records = [Record(True, 1.0, 0.2, output_tokens=5, chunks=5), Record(True, 3.0, 1.0, output_tokens=5, chunks=5),
               Record(True, 2.0, 2.0, output_tokens=5, chunks=1),  # one chunk: no TPOT
               Record(False, 0.1, 0.0, error="x")]
    s = summarize(LoadResult(records, wall_s=10.0), input_tokens=100)
    assert s["req_s"] == pytest.approx(0.3) and s["rpm"] == pytest.approx(18)
    assert s["input_tok_s"] == pytest.approx(30) and s["output_tok_s"] == pytest.approx(1.5)
    assert s["e2e_p50_ms"] == pytest.approx(2000) and s["ttft_p50_ms"] == pytest.approx(1000)
    assert s["tpot_p50_ms"] == pytest.approx(1000 * (0.2 + 0.5) / 2)  # (0.8/4, 2.0/4)


def test_percentile_interpolates() -> None:
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([5], 95) == 5
    assert math.isnan(percentile([], 50))


def test_a_stream_cut_before_done_is_a_failure() -> None:
    res = _run(FakeServer(done=False), ["p0", "p1"], LoadSpec(concurrency=1, warmup=0))
    assert [r.ok for r in res.records] == [False, False]
    assert all("[DONE]" in r.error for r in res.records)


def test_a_sender_that_raises_is_recorded_and_the_run_goes_on() -> None:
    async def send(client: httpx.AsyncClient, payload: str) -> Record:
        if payload == "bad":
            raise ValueError("unparseable event")
        return Record(True, 0.001, 0.001)

    res = asyncio.run(run_load(send, ["a", "bad", "b"], LoadSpec(concurrency=2, warmup=0)))
    assert sorted(r.ok for r in res.records) == [False, True, True]
    assert "ValueError: unparseable event" in next(r.error for r in res.records if not r.ok)


def test_open_loop_latency_counts_from_the_scheduled_arrival() -> None:
    """Arrivals far faster than one slot serves: later requests wait in the client, and
    that wait is part of their latency (it used to start after the semaphore)."""
    server = FakeServer(delay=0.03)
    res = _run(server, [f"p{i}" for i in range(5)], LoadSpec(concurrency=1, rate=10_000.0, warmup=0, seed=1))
    assert all(r.ok for r in res.records)
    e2e = sorted(r.e2e_s for r in res.records)
    assert e2e[-1] >= 4 * 0.03  # the last arrival queued behind four 30 ms requests
    assert max(r.queued_s for r in res.records) >= 3 * 0.03
    assert all(r.ttft_s >= r.queued_s for r in res.records)
