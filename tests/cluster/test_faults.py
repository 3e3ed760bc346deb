"""A replica killed mid-load: no request is lost or hangs, the counts add up on the
client side, /health says degraded until Ray has restarted the replica."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterator

import httpx
import pytest

ray = pytest.importorskip("ray")

from prelude.cluster.client import FaultConfig, RayEngineClient  # noqa: E402
from prelude.cluster.launch import ClusterConfig, start_client  # noqa: E402

from tests.cluster.tiny_replica import tiny_factory  # noqa: E402
from tests.entrypoints.conftest import running_server  # noqa: E402


@pytest.fixture(scope="module")
def cluster(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RayEngineClient]]:
    client = start_client(
        tiny_factory(tmp_path_factory.mktemp("tiny")),
        ClusterConfig(num_replicas=2, replica_threads=1, faults=FaultConfig(poll_s=0.2, wait_for_replica_s=60)),
    )
    with running_server(client) as base:
        yield base, client


async def _stream(http: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> tuple[str, int]:
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


def test_killed_replica_loses_no_request(cluster) -> None:  # noqa: ANN001
    base, client = cluster
    victim = client._replicas[0]
    old_pid = ray.get(victim.pid.remote())

    async def run() -> tuple[list[tuple[str, int]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=60) as http:
            first = [asyncio.create_task(_stream(http, base, i, 150)) for i in range(8)]
            while sum(client._in_flight) < 8 or client.metrics()["requests_running"] < 4:
                await asyncio.sleep(0.02)
            ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts=-1)
            # Sent right after the kill: some are routed to the dead replica and must move.
            later = [asyncio.create_task(_stream(http, base, 100 + i, 20)) for i in range(8)]
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
    assert m["cluster_failed_mid_stream_total"] == states.count("error")
    assert states.count("error") >= 1  # the victim held some of the first wave
    assert {"status": "degraded", "replicas_live": 1, "replicas_total": 2} in healths
    assert healths[-1]["status"] == "ok"  # Ray restarted it; the front noticed
    assert ray.get(victim.pid.remote()) != old_pid
    assert m["cluster_replica_recoveries_total"] >= 1
    client.check_integrity()
    # The restarted replica serves again.
    r = httpx.post(base + "/v1/completions", json={"prompt": "again", "max_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
