"""A replica call the front abandoned ends even when Ray's cancel missed it
(cluster/call_ledger.py): abandoned before it begins, it submits nothing; abandoned while
it runs, its request is aborted and its blocks freed; a ticket names one call, so the
same request id under a new ticket runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prelude.cluster.call_ledger import CallLedger
from prelude.engine.request import SamplingParams

pytest.importorskip("transformers")

from tests.cluster.tiny_replica import tiny_factory  # noqa: E402


# Tasks stand in as plain markers here: the ledger only keeps and returns them.
TASK_1, TASK_2 = object(), object()


def test_ledger_refuses_a_ticket_abandoned_before_its_call_began() -> None:
    calls = CallLedger()
    assert calls.abandon("t1") is None  # not begun: remembered
    assert not calls.begin("t1", TASK_1)  # begins late: refused, once
    assert calls.begin("t2", TASK_2) and calls.live == 1  # another call runs
    assert calls.abandon("t2") is TASK_2 and calls.live == 0  # running: its task is the one to cancel
    calls.end("t2")  # the call's own cleanup after the cancel: harmless
    assert calls.begin("t1", TASK_1)  # a refused ticket is forgotten once used


def test_ledger_forgets_the_oldest_abandoned_tickets_past_its_bound() -> None:
    calls = CallLedger(remembered=2)
    for t in ("a", "b", "c"):
        calls.abandon(t)
    assert calls.begin("a", TASK_1) and not calls.begin("b", TASK_1) and not calls.begin("c", TASK_1)


def test_ledger_ended_call_is_not_aborted() -> None:
    calls = CallLedger()
    assert calls.begin("t", TASK_1)
    calls.end("t")
    assert calls.abandon("t") is None  # ended on its own before the front's word came


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from prelude.cluster.replica import EngineReplica

    r = EngineReplica(tiny_factory(Path(tmp_path_factory.mktemp("tiny"))), index=0, threads=1)
    yield r
    r.front.shutdown()


def _request(replica, rid: str, max_tokens: int):  # noqa: ANN001, ANN202
    return replica.front.engine.prepare(rid, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                         ignore_eos=True), None)


def test_call_abandoned_before_it_began_submits_nothing(replica) -> None:  # noqa: ANN001
    async def run() -> list[object]:
        await replica.abandon("front-1")
        return [out async for out in replica.generate(_request(replica, "late", 50), "front-1")]

    assert asyncio.run(run()) == []
    engine = replica.front.engine
    assert engine.metrics()["requests_running"] == 0 and not engine.has_unfinished()
    assert replica.metrics()["in_flight"] == 0
    # the same request id under a new ticket runs to its end
    async def again() -> list[object]:
        return [out async for out in replica.generate(_request(replica, "late", 3), "front-2")]

    outs = asyncio.run(again())
    assert outs[-1].finished and outs[-1].num_output_tokens == 3


def test_call_abandoned_while_running_aborts_its_request(replica) -> None:  # noqa: ANN001
    """Ray drives a streamed call in a task of its own; `abandon` cancels that task, and
    the call's cleanup aborts the request, as Ray's own cancel does."""
    async def run() -> list[object]:
        outs: list[object] = []
        first = asyncio.Event()

        async def drive() -> None:  # what Ray does with a streamed call
            async for out in replica.generate(_request(replica, "running", 200), "front-3"):
                outs.append(out)
                first.set()

        task = asyncio.create_task(drive())
        await first.wait()  # the call runs: the front's cancel never reached it
        await replica.abandon("front-3")
        with pytest.raises(asyncio.CancelledError):
            await task
        return outs

    outs = asyncio.run(run())
    assert outs and not outs[-1].finished and len(outs) < 200
    engine = replica.front.engine
    assert asyncio.run(_idle(engine)) and engine.metrics()["requests_running"] == 0
    engine.check_integrity()
    assert replica.metrics()["in_flight"] == 0


async def _idle(engine, seconds: float = 10.0) -> bool:  # noqa: ANN001
    for _ in range(int(seconds / 0.01)):
        if not engine.has_unfinished():
            return True
        await asyncio.sleep(0.01)
    return False
