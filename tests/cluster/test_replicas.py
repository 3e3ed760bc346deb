"""Two engine replicas on Ray behind the HTTP app answer exactly like one in-process
engine (greedy): completions, chat, streaming, n > 1, OneShot APIs; aborted streams
free their blocks on every replica; prefix routing keeps a prefix on one replica;
LAPS pools split prompts by length. Last, a replica killed mid-load: no request is
lost or hangs, the counts add up on the client side, /health says degraded until Ray
has restarted the replica. (One module: the replicas take seconds to start.)"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from contextlib import ExitStack
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from prelude.cluster.client import RayEngineClient  # noqa: E402
from prelude.cluster.launch import ClusterConfig, start_client  # noqa: E402
from prelude.cluster.router import Router, RouterConfig  # noqa: E402
from prelude.engine.async_engine import AsyncEngine  # noqa: E402
from prelude.engine.request import SamplingParams  # noqa: E402

from tests.cluster.tiny_replica import tiny_factory  # noqa: E402
from tests.entrypoints.conftest import running_server  # noqa: E402


@pytest.fixture(scope="module")
def pair(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, RayEngineClient]]:
    """(one-engine server, two-replica server, the replicas' client)."""
    factory = tiny_factory(tmp_path_factory.mktemp("tiny"))
    with ExitStack() as stack:
        one = stack.enter_context(running_server(AsyncEngine(factory)))
        client = start_client(factory, ClusterConfig(num_replicas=2, replica_threads=1))
        two = stack.enter_context(running_server(client))
        yield one, two, client


def _post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _answer(payload: dict[str, Any]) -> Any:
    """What must be equal: everything but ids and timestamps."""
    return {k: v for k, v in payload.items() if k not in ("id", "created")}


def _close(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-4 (replicas run 1 torch thread, the reference 2)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-4, abs=1e-5)
    return a == b


def _stream(base: str, path: str, body: dict[str, Any]) -> dict[int, tuple[str, str | None]]:
    """Each choice's streamed text and finish reason (choices interleave by timing)."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                reasons[c["index"]] = c.get("finish_reason") or reasons.get(c["index"])
    return {i: (texts[i], reasons[i]) for i in texts}


GREEDY = {"temperature": 0, "ignore_eos": True}
CASES = [
    ("/v1/completions", {"prompt": ["hello world", "the quick brown fox"], "max_tokens": 12, "n": 2, **GREEDY}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 6, "logprobs": 2, "echo": True, **GREEDY}),
    ("/v1/completions", {"prompt": "seeded", "max_tokens": 6, "n": 3, "seed": 7, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10, **GREEDY}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}),  # OneShot
    ("/v1/embeddings", {"input": ["one", "two"], "pooling": "mean"}),
    ("/classify", {"input": ["judge this", "and this"], "labels": ["a", "b", "c"]}),
    ("/v1/completions", {"prompt": "pick one:", "max_tokens": 8, "n": 2, "temperature": 0,
                         "guided_choice": ["yes", "no", "maybe"]}),
]


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_two_replicas_answer_like_one_engine(pair, path: str, body: dict[str, Any]) -> None:  # noqa: ANN001
    one, two, _ = pair
    got, want = _answer(_post(two, path, body)), _answer(_post(one, path, body))
    assert _close(got, want), (got, want)


@pytest.mark.parametrize("path,body", [CASES[0], CASES[3]], ids=["completions", "chat"])
def test_streams_equal(pair, path: str, body: dict[str, Any]) -> None:  # noqa: ANN001
    one, two, _ = pair
    got, want = _stream(two, path, body), _stream(one, path, body)
    assert got == want and len(got) == body.get("n", 1) * (len(body["prompt"]) if "prompt" in body else 1)


def test_structured_outputs_are_applied_on_replicas(pair) -> None:  # noqa: ANN001
    """The front checks the constraint, the replica builds its matcher: a random tiny model
    says one of the choices only because the grammar holds it there."""
    _, two, _ = pair
    body = {"prompt": "pick one:", "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 3,
            "guided_choice": ["yes", "no", "maybe"]}
    texts = [c["text"] for c in _post(two, "/v1/completions", body)["choices"]]
    assert texts and all(t in ("yes", "no", "maybe") for t in texts), texts
    free = _post(two, "/v1/completions", {k: v for k, v in body.items() if k != "guided_choice"})
    assert any(c["text"] not in ("yes", "no", "maybe") for c in free["choices"])  # the model alone would not


def test_bad_request_is_400_and_metrics_and_health(pair) -> None:  # noqa: ANN001
    _, two, client = pair
    r = httpx.post(two + "/v1/completions", json={"prompt": "x" * 300, "max_tokens": 5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(two + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "guided_regex": "(["}, timeout=30)
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    assert httpx.get(two + "/health").json() == {"status": "ok", "replicas_live": 2, "replicas_total": 2}
    for _ in range(2):  # round robin: one on each replica
        _post(two, "/v1/completions", {"prompt": "ok", "max_tokens": 2})
    text = httpx.get(two + "/metrics").text
    assert 'prelude:router_decisions_total{reason="round_robin",replica="1"}' in text
    assert sum(line.startswith("# TYPE prelude:router_decisions") for line in text.splitlines()) == 1
    assert 'prelude:replica_prefix_cache_hit_rate{replica="0"}' in text
    assert 'prelude:replica_up{replica="1"} 1.0' in text


def test_abandoned_streams_free_blocks_on_every_replica(pair) -> None:  # noqa: ANN001
    _, two, client = pair
    body = {"prompt": "a long one", "max_tokens": 200, "stream": True, **GREEDY}
    for _ in range(6):
        with httpx.stream("POST", two + "/v1/completions", json=body, timeout=30) as r:
            next(r.iter_lines())  # the first event, then the client walks away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and client.metrics()["requests_running"]:
        time.sleep(0.1)
    assert client.metrics()["requests_running"] == 0
    client.check_integrity()


def test_prefix_router_keeps_a_prefix_on_one_replica_and_spreads_load(pair) -> None:  # noqa: ANN001
    _, _, owner = pair
    router = Router(RouterConfig(policy="prefix", block_size=4, balance_abs_threshold=3), 2)
    client = RayEngineClient(owner._replicas, router, owner.info)
    prefixes = ["system prompt number one: ", "another shared preamble!! "]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def one(rid: str, text: str) -> int:
        n = 0
        async for out in client.generate(rid, list(text.encode()), params):
            n += len(out.new_token_ids)
        return n

    async def run() -> None:
        # Sequential: each prefix's later requests should follow the first.
        for i in range(6):
            for j, p in enumerate(prefixes):
                assert await one(f"seq-{j}-{i}", p + f"question {i}") == 3
        # A burst of one prefix: the balance threshold must spread it.
        assert await asyncio.gather(*(one(f"burst-{i}", prefixes[0] + f"q{i}") for i in range(12))) == [3] * 12

    try:
        asyncio.run(run())
        d = router.stats.decisions
        sequential_home = {r for (r, reason), n in d.items() if reason == "prefix_match"}
        assert sum(n for (_, reason), n in d.items() if reason == "prefix_match") >= 10
        assert len(sequential_home) == 2  # the two prefixes live on different replicas
        assert d[(0, "balance")] + d[(1, "balance")] > 0  # the burst spilled over
        assert router.estimated_hit_rate(0) > 0.5 and router.estimated_hit_rate(1) > 0.5
    finally:
        client.close()
    owner.check_integrity()


def test_laps_pools_split_short_and_long_prompts(pair) -> None:  # noqa: ANN001
    from prelude.cluster.pools import PoolConfig, PoolController

    _, _, owner = pair
    pools = PoolController(PoolConfig(boundary=32, min_pressure=10_000), [0], [1])
    client = RayEngineClient(owner._replicas, Router(RouterConfig("least_load"), 2), owner.info, pools=pools)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def one(rid: str, n: int) -> None:
        async for _ in client.generate(rid, [65 + i % 26 for i in range(n)], params):
            pass

    async def run() -> None:
        await asyncio.gather(*(one(f"laps-{i}", 8 if i % 2 else 100) for i in range(8)))

    try:
        asyncio.run(run())
        d = client._router.stats.decisions
        assert d[(0, "least_load")] == 4 and d[(1, "least_load")] == 4  # shorts on 0, longs on 1
        m = {(name, tuple(labels.values())): v for name, _, _, labels, v in client.cluster_metrics()}
        assert m[("laps_pool_replicas", ("short",))] == 1 and m[("laps_pool_moves", ())] == 0
    finally:
        client.close()
    owner.check_integrity()


async def _stream_counted(http: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> tuple[str, int]:
    """('done', tokens) | ('error', tokens streamed before the error event) | ('http_<status>', 0)."""
    body = {"prompt": f"request {i} says hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"http_{r.status_code}", 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "error", tokens
            if event.get("usage"):
                assert event["usage"]["completion_tokens"] == max_tokens
                return "done", tokens
            tokens += sum(1 for c in event["choices"] if c.get("text") is not None)
    return "cut", tokens  # the stream ended without a final event: a lost request


def _wait_healthy(client: RayEngineClient, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and client.health()["status"] != "ok":
        time.sleep(0.2)
    assert client.health()["status"] == "ok"


def test_replica_process_killed_under_non_streamed_load_answers_every_request(pair, caplog) -> None:  # noqa: ANN001
    """The issue's case: 24 concurrent non-streamed completions on 2 replicas, one
    replica's process killed with SIGKILL once every request on it has produced output
    (an event, not a delay). Nothing had reached those clients: each runs again on the
    live replica, and all 24 answer 200 in full. The dead replica is marked down, Ray
    restarts it, and it serves again."""
    _, base, client = pair
    _wait_healthy(client)
    victim = client._replicas[0]
    old_pid = ray.get(victim.ping.remote())
    before = client.metrics()
    body = {"prompt": "keep going", "max_tokens": 120, "ignore_eos": True, "temperature": 0}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:
            tasks = [asyncio.create_task(http.post(base + "/v1/completions", json={**body, "prompt": f"p{i} go"}))
                     for i in range(24)]
            deadline = time.monotonic() + 120
            # every request is on a replica, and each of the victim's has its first token
            while (sum(client._in_flight) < 24 or client._unprefilled[0] > 0) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert client._in_flight[0] > 0 and client._unprefilled[0] == 0
            os.kill(old_pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    with caplog.at_level(logging.WARNING):
        answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 24, [a.text[:200] for a in answers if a.status_code != 200]
    assert all(a.json()["usage"]["completion_tokens"] == 120 for a in answers)
    m = client.metrics()
    assert m["cluster_replica_failures_total"] > before["cluster_replica_failures_total"]
    reruns = m["cluster_rerun_total"] - before["cluster_rerun_total"]
    assert reruns >= 1 and m["cluster_failed_mid_stream_total"] - before["cluster_failed_mid_stream_total"] == reruns
    logged = [r.getMessage() for r in caplog.records if "runs again from the start" in r.getMessage()]
    assert len(logged) == reruns and all(line.startswith("request cmpl-") for line in logged), logged
    _wait_healthy(client)  # restarted by Ray, back in the router
    assert ray.get(victim.ping.remote()) != old_pid
    served_before = len(ray.get(victim.request_metrics.remote()))
    for i in range(4):  # round robin: the restarted replica gets its share
        r = httpx.post(base + "/v1/completions", json={"prompt": f"again {i}", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200
    assert len(ray.get(victim.request_metrics.remote())) > served_before
    client.check_integrity()


def test_killed_replica_loses_no_request(pair) -> None:  # noqa: ANN001
    """Last in this module: it kills one of the pair's replicas (Ray restarts it)."""
    _, base, client = pair
    _wait_healthy(client)
    victim = client._replicas[0]
    old_pid = ray.get(victim.ping.remote())
    before = client.metrics()

    async def run() -> tuple[list[tuple[str, int]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=60) as http:
            first = [asyncio.create_task(_stream_counted(http, base, i, 150)) for i in range(8)]
            while sum(client._in_flight) < 8 or client.metrics()["requests_running"] < 4:
                await asyncio.sleep(0.02)
            ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts=-1)
            # Sent right after the kill: some are routed to the dead replica and must move.
            later = [asyncio.create_task(_stream_counted(http, base, 100 + i, 20)) for i in range(8)]
            healths = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                healths.append((await http.get(base + "/health")).json())
                if healths[-1]["status"] == "ok" and any(h["status"] == "degraded" for h in healths):
                    break
                await asyncio.sleep(0.2)
            return await asyncio.wait_for(asyncio.gather(*first, *later), 60), healths

    results, healths = asyncio.run(run())
    states = [s for s, _ in results]
    assert "cut" not in states and not any(s.startswith("http_") for s in states), results
    assert len(results) == 16 and set(states) <= {"done", "error"}
    # An error event only ends a stream that had started; the rest completed.
    assert all(n > 0 for s, n in results if s == "error")
    m = client.metrics()
    assert m["cluster_failed_mid_stream_total"] - before["cluster_failed_mid_stream_total"] == states.count("error")
    # The victim held some of the first wave: they moved (nothing streamed yet) or ended
    # with an error event (under load the kill may land before any of them streamed).
    assert m["cluster_retried_total"] - before["cluster_retried_total"] + states.count("error") >= 1
    assert {"status": "degraded", "replicas_live": 1, "replicas_total": 2} in healths
    assert healths[-1]["status"] == "ok"  # Ray restarted it; the front noticed
    assert ray.get(victim.ping.remote()) != old_pid
    assert m["cluster_replica_recoveries_total"] >= 1
    client.check_integrity()
    # The restarted replica serves again.
    r = httpx.post(base + "/v1/completions", json={"prompt": "again", "max_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
