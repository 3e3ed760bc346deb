"""The disaggregated front's backpressure (HandoffGate over the DecodePlacer), without Ray:
hand-offs past the cap wait first come first served, a release lets exactly the next one
in, a waiter that goes away frees its place in line, and with no decode replica live a
hand-off gives up after the bounded wait. And the flags that configure it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from prelude.cluster.disagg import HandoffGate  # noqa: E402
from prelude.cluster.pools import DecodePlacer  # noqa: E402
from prelude.engine.client import EngineUnavailableError  # noqa: E402


def test_fifo_backpressure_at_the_cap() -> None:
    async def run() -> None:
        gate = HandoffGate(DecodePlacer(2, [0, 0, 0]), recheck_s=10.0)  # decode replicas 1 and 2, cap 2
        live = lambda: [1, 2]  # noqa: E731
        first = [await gate.acquire(live, 1.0) for _ in range(4)]
        assert sorted(first) == [1, 1, 2, 2] and gate.placer.held == [0, 2, 2]
        order: list[int] = []

        async def wait(i: int) -> int:
            d = await gate.acquire(live, 1.0)
            order.append(i)
            return d

        waiters = [asyncio.create_task(wait(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert gate.waiting == 3 and not order and gate.waited == 3
        waiters[1].cancel()  # a client leaves while its hand-off waits
        await asyncio.sleep(0.01)
        assert gate.waiting == 2
        gate.release(2)
        await asyncio.sleep(0.01)
        assert order == [0] and waiters[0].result() == 2 and gate.placer.held == [0, 2, 2]
        gate.release(1)
        await asyncio.sleep(0.01)
        assert order == [0, 2] and waiters[2].result() == 1
        assert gate.max_held == [0, 2, 2] and gate.waiting == 0

    asyncio.run(run())


def test_no_live_decode_replica_gives_up() -> None:
    async def run() -> None:
        gate = HandoffGate(DecodePlacer(4, [0, 0]), recheck_s=0.01)
        with pytest.raises(EngineUnavailableError):
            await gate.acquire(lambda: [], 0.05)
        assert gate.waiting == 0
        # A replica that comes back is found by the periodic re-check.
        live: list[int] = []
        task = asyncio.create_task(gate.acquire(lambda: live, 5.0))
        await asyncio.sleep(0.03)
        live.append(1)
        assert await asyncio.wait_for(task, 30.0) == 1

    asyncio.run(run())


def _cluster(*flags: str):  # noqa: ANN202
    import argparse

    from prelude import cli

    p = argparse.ArgumentParser()
    cli._add_engine_args(p)
    cli._add_cluster_args(p)
    return cli._cluster_config(p.parse_args(list(flags)))


def test_disaggregate_flags() -> None:
    c = _cluster("--disaggregate", "1:2", "--max-num-seqs", "24")
    assert c.disaggregate == (1, 2) and c.num_replicas == 3 and c.num_prefill == 1
    assert c.max_requests_in_scheduler == 24  # defaults to --max-num-seqs
    assert _cluster("--disaggregate", "2:1", "--max-requests-in-scheduler", "5").max_requests_in_scheduler == 5
    # LAPS pools split the prefill replicas.
    assert _cluster("--disaggregate", "2:1", "--laps-pools", "1:1").laps_pools == (1, 1)
    with pytest.raises(ValueError, match="--laps-pools"):
        _cluster("--disaggregate", "2:1", "--laps-pools", "2:1")
    with pytest.raises(ValueError, match="--disaggregate"):
        _cluster("--disaggregate", "0:2")
    with pytest.raises(ValueError, match="--disaggregate"):
        _cluster("--disaggregate", "1:1", "--data-parallel-size", "3")
    with pytest.raises(SystemExit):
        _cluster("--disaggregate", "one:two")


class _FakeDecodeReplica:
    """A decode replica whose `decode` stream raises `fail` before its first output, or
    streams `outputs` (the Ray call shape: `.decode.options(...).remote(handoff)`)."""

    def __init__(self, fail: BaseException | None, outputs: list[object]) -> None:
        self.fail, self.outputs, self.calls = fail, outputs, 0
        self.decode = self
        self.abandoned: list[str] = []  # tickets of the calls the front abandoned
        self.abandon = SimpleNamespace(remote=self.abandoned.append)

    def options(self, **_: object) -> "_FakeDecodeReplica":
        return self

    def remote(self, handoff: object, ticket: str) -> object:
        self.calls += 1

        async def stream():  # noqa: ANN202
            if self.fail is not None:
                raise self.fail
            for out in self.outputs:
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(out)
                yield fut

        return stream()


def _front(replicas: list[object]):  # noqa: ANN202
    from prelude.cluster.client import FaultConfig
    from prelude.cluster.disagg import DisaggregatedClient
    from prelude.cluster.router import Router, RouterConfig

    front = DisaggregatedClient(replicas, Router(RouterConfig(), len(replicas)), num_prefill=1,
                                max_requests_in_scheduler=4, info=SimpleNamespace(model_name="m"),
                                faults=FaultConfig(poll_s=0.05, wait_for_replica_s=0.5))
    front.close()  # no monitor: the fakes answer no pings (what is up is what _decode marks)
    return front


def _request():  # noqa: ANN202
    return SimpleNamespace(request_id="r1")  # all _decode reads of its request


def test_lost_handoff_is_not_charged_to_the_live_decode_replica(monkeypatch) -> None:  # noqa: ANN001
    """A hand-off that died with its prefill replica comes back from the decode call as
    RayTaskError(ActorUnavailableError), which is also an ActorUnavailableError: the decode
    replica stays up and is not retried, and the request ends with ReplicaLostError (a
    non-streamed answer runs again from the start)."""
    from ray.exceptions import ActorUnavailableError, RayTaskError

    from prelude.engine.client import ReplicaLostError

    monkeypatch.setattr("prelude.cluster.disagg.ray.cancel", lambda gen: None)
    lost = RayTaskError("decode", "tb", ActorUnavailableError("the prefill actor is gone", None)).as_instanceof_cause()
    decode = _FakeDecodeReplica(lost, [])
    front = _front([object(), decode])

    async def run() -> None:
        async for _ in front._decode(_request(), handoff=object()):
            pass

    with pytest.raises(ReplicaLostError, match="prefill replica"):
        asyncio.run(run())
    assert decode.calls == 1 and front._up == [True, True]
    assert len(decode.abandoned) == 1  # the live replica is told to drop the call, should it begin late
    assert front._counts["handoffs_lost_total"] == 1 and front._counts["decode_retried_total"] == 0
    assert front._counts["replica_failures_total"] == 0 and "r1" in front._lost
    assert front.gate.placer.held == [0, 0]


def test_dead_decode_replica_moves_the_handoff_to_another(monkeypatch) -> None:  # noqa: ANN001
    """The decode replica itself died before streaming (a bare ActorUnavailableError): it
    is marked down and the same hand-off goes to the other decode replica."""
    from ray.exceptions import ActorUnavailableError

    monkeypatch.setattr("prelude.cluster.disagg.ray.cancel", lambda gen: None)
    done = SimpleNamespace(request_id="r1", finished=True)
    dead = _FakeDecodeReplica(ActorUnavailableError("decode actor died", None), [])
    live = _FakeDecodeReplica(None, [done])
    front = _front([object(), dead, live])

    async def run() -> list[object]:
        return [out async for out in front._decode(_request(), handoff=object())]

    assert asyncio.run(run()) == [done]
    assert (dead.calls, live.calls) == (1, 1) and front._up == [True, False, True]
    assert dead.abandoned == [] and live.abandoned == []  # nothing to tell a dead replica; the live one finished
    assert front._counts["decode_retried_total"] == 1 and front._counts["handoffs_lost_total"] == 0
