"""A hybrid model (random Qwen3.5: Gated DeltaNet and gated attention layers, recurrent
state slots) on Ray: two replicas, and a 1:1 prefill/decode split whose hand-off carries
the recurrent state, answer like one in-process engine (greedy, seeded, logprobs,
structured outputs, OneShot routes, streams); every replica's blocks and slots pass the
integrity check after. (Slow: Ray and four replicas start.)"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any, Iterator

import pytest

pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from prelude.cluster.client import RayEngineClient  # noqa: E402
from prelude.cluster.disagg import DisaggregatedClient  # noqa: E402
from prelude.cluster.launch import ClusterConfig, start_client  # noqa: E402
from prelude.engine.async_engine import AsyncEngine  # noqa: E402

from tests.cluster.test_replicas import CASES, _answer, _close, _post, _stream  # noqa: E402
from tests.cluster.tiny_replica import tiny_hybrid_factory  # noqa: E402
from tests.entrypoints.conftest import running_server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(ray_local: None, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, dict[str, str], dict[str, RayEngineClient | DisaggregatedClient]]]:
    """(one in-process engine's server, {"replicas", "disaggregated"}: their servers, their clients)."""
    directory = tmp_path_factory.mktemp("hybrid")
    factory = tiny_hybrid_factory(directory)
    with ExitStack() as stack:
        one = stack.enter_context(running_server(AsyncEngine(factory)))
        clients: dict[str, RayEngineClient | DisaggregatedClient] = {
            "replicas": start_client(factory, ClusterConfig(num_replicas=2, replica_threads=1)),
            "disaggregated": start_client(tiny_hybrid_factory(directory, policy="srpt"),
                                          ClusterConfig(num_replicas=2, replica_threads=1, disaggregate=(1, 1)),
                                          decode_factory=tiny_hybrid_factory(directory, policy="mlfq")),
        }
        assert isinstance(clients["disaggregated"], DisaggregatedClient)
        bases = {name: stack.enter_context(running_server(client)) for name, client in clients.items()}
        yield one, bases, clients


def _settled(client: RayEngineClient | DisaggregatedClient) -> None:
    """Nothing running on any replica, then every replica's blocks and slots consistent."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and client.metrics()["requests_running"]:
        time.sleep(0.05)
    assert client.metrics()["requests_running"] == 0
    client.check_integrity()


@pytest.mark.parametrize("kind", ["replicas", "disaggregated"])
@pytest.mark.parametrize("path,body", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_a_hybrid_model_on_ray_answers_like_one_engine(servers, kind: str, path: str,  # noqa: ANN001
                                                       body: dict[str, Any]) -> None:
    one, bases, clients = servers
    got, want = _answer(_post(bases[kind], path, body)), _answer(_post(one, path, body))
    assert _close(got, want), (got, want)
    _settled(clients[kind])


@pytest.mark.parametrize("kind", ["replicas", "disaggregated"])
def test_streams_equal(servers, kind: str) -> None:  # noqa: ANN001
    one, bases, clients = servers
    path, body = CASES[0]
    assert _stream(bases[kind], path, body) == _stream(one, path, body)
    _settled(clients[kind])


def test_the_decode_replica_took_hand_offs(servers) -> None:  # noqa: ANN001
    one, bases, clients = servers
    _post(bases["disaggregated"], "/v1/completions", {"prompt": "a longer prompt here", "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
    totals = {k: sum(m.get(k, 0) for m in clients["disaggregated"].replica_metrics().values())
              for k in ("kv_handoffs_exported_total", "kv_handoffs_imported_total")}
    assert totals["kv_handoffs_exported_total"] >= 1
    assert totals["kv_handoffs_imported_total"] == totals["kv_handoffs_exported_total"]
