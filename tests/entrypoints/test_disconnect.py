"""until_disconnect: a client that goes away cancels its work at once; one that stays
costs nothing while it waits; a batch line is never listened to."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest

from prelude.entrypoints.openai import disconnect
from prelude.entrypoints.openai.disconnect import ClientDisconnected, StaysConnected, until_disconnect
from prelude.entrypoints.openai.limits import ServerLimits
from prelude.entrypoints.openai.offline import OfflineRequest


class _Client:
    """An HTTP request stand-in: receive() hands out `messages`, then blocks (the client stays)."""

    def __init__(self, *messages: dict[str, Any]) -> None:
        self.messages = list(messages)
        self.received = 0

    async def receive(self) -> dict[str, Any]:
        self.received += 1
        if self.messages:
            return self.messages.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def _forever(started: list[bool]) -> None:
    started.append(True)
    await asyncio.Event().wait()


def test_a_client_that_goes_away_cancels_the_work() -> None:
    started: list[bool] = []
    work_cancelled = []

    async def work() -> None:
        try:
            await _forever(started)
        except asyncio.CancelledError:
            work_cancelled.append(True)
            raise

    async def run() -> None:
        with pytest.raises(ClientDisconnected):
            await until_disconnect(work(), _Client({"type": "http.disconnect"}))  # type: ignore[arg-type]

    asyncio.run(run())
    assert started == [True] and work_cancelled == [True]


def test_a_client_that_stays_gets_the_answer_and_leaves_no_listener_behind() -> None:
    client = _Client()

    async def answer() -> str:
        await asyncio.sleep(0)
        return "answer"

    async def run() -> tuple[str, int]:
        result = await until_disconnect(answer(), client)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # let the cancelled listener finish
        return result, len(asyncio.all_tasks())

    result, tasks = asyncio.run(run())
    assert result == "answer" and tasks == 1  # only run() itself
    assert client.received == 1  # one receive() for the whole wait: nothing polled


def test_other_messages_before_the_disconnect_are_read_past(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disconnect, "_ODD_MESSAGE_WAIT_S", 0.0)
    client = _Client({"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"})

    async def run() -> None:
        with pytest.raises(ClientDisconnected):
            await until_disconnect(_forever([]), client)  # type: ignore[arg-type]

    asyncio.run(run())
    assert client.received == 2


def test_a_batch_line_is_never_listened_to() -> None:
    class Line(OfflineRequest):
        received = 0

        async def receive(self) -> dict[str, Any]:
            Line.received += 1
            return {"type": "http.disconnect"}

    async def answer() -> str:
        await asyncio.sleep(0)
        return "answer"

    request = Line(ServerLimits(), 0)
    assert isinstance(request, StaysConnected)
    assert asyncio.run(until_disconnect(answer(), request)) == "answer"  # type: ignore[arg-type]
    assert Line.received == 0


def test_a_finished_request_is_freed_without_the_cyclic_collector() -> None:
    """No reference cycle outlives the call: the request (here its stand-in) goes as soon
    as the handler drops it. A cycle there kept every served request's scope, body and
    answer alive until the cyclic collector ran (~44 objects of garbage a request)."""

    async def run() -> tuple[str, weakref.ref[_Client]]:
        client = _Client()
        gone = weakref.ref(client)

        async def answer() -> str:
            await asyncio.sleep(0)
            return "answer"

        result = await until_disconnect(answer(), client)  # type: ignore[arg-type]
        del client
        for _ in range(3):  # the cancelled listener finishes
            await asyncio.sleep(0)
        return result, gone

    gc.disable()
    try:
        answer, gone = asyncio.run(run())
        assert answer == "answer"
        assert gone() is None
    finally:
        gc.enable()
