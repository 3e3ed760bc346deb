"""until_disconnect polls a client that can go away, and leaves alone one that can not."""

from __future__ import annotations

import asyncio

import pytest

from prelude.entrypoints.openai.disconnect import ClientDisconnected, StaysConnected, until_disconnect
from prelude.entrypoints.openai.offline import OfflineRequest
from prelude.entrypoints.openai.limits import ServerLimits


class _Client:
    """An HTTP request stand-in whose client is gone from the start."""

    def __init__(self) -> None:
        self.asked = 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return True


def _record_timers(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    loop = asyncio.get_running_loop()
    delays: list[float] = []
    real = loop.call_later

    def call_later(delay: float, callback, *args):  # type: ignore[no-untyped-def]
        delays.append(delay)
        return real(0, callback, *args)  # the poll comes due at once: no waiting in the test

    monkeypatch.setattr(loop, "call_later", call_later)
    return delays


async def _answer() -> str:
    await asyncio.sleep(0)
    return "answer"


def test_a_batch_line_is_never_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> tuple[str, list[float]]:
        delays = _record_timers(monkeypatch)
        request = OfflineRequest(ServerLimits(), 0)
        assert isinstance(request, StaysConnected)
        return await until_disconnect(_answer(), request), delays  # type: ignore[arg-type]

    answer, delays = asyncio.run(run())
    assert answer == "answer"
    assert delays == []


def test_a_client_that_goes_away_cancels_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    started = []

    async def forever() -> None:
        started.append(True)
        await asyncio.Event().wait()

    async def run() -> tuple[_Client, list[float]]:
        delays = _record_timers(monkeypatch)
        client = _Client()
        with pytest.raises(ClientDisconnected):
            await until_disconnect(forever(), client)  # type: ignore[arg-type]
        return client, delays

    client, delays = asyncio.run(run())
    assert started == [True]
    assert client.asked == 1
    assert len(delays) == 1
