"""A client that goes away: the work it was waiting for is cancelled, which aborts its
engine requests and frees their KV blocks."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import Request as HTTPRequest

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the answer was ready."""


class StaysConnected:
    """What a request stands in for when its client can not go away (a batch line):
    nothing to listen to."""


_ODD_MESSAGE_WAIT_S = 0.1  # a server that answers receive() with other messages is asked again this late


async def until_disconnect(work: Awaitable[T], http_request: HTTPRequest | StaysConnected | None) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the HTTP
    client goes away meanwhile.

    A listener waits on the request's ASGI `receive()`: once the body is read, the server
    answers it only when the client disconnects (or the response is complete), so nothing
    runs while the client stays, and a disconnect cancels the work at once. (Polling
    `is_disconnected()` from a timer cost a task and a timer a poll: under concurrent
    short requests, a large share of the event loop's time.)"""
    if http_request is None or isinstance(http_request, StaysConnected):
        return await work
    task = asyncio.ensure_future(work)
    gone = False

    async def listen() -> None:
        nonlocal gone
        while (await http_request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(_ODD_MESSAGE_WAIT_S)  # not the ASGI contract: never a busy loop
        gone = True
        task.cancel()

    listener = asyncio.get_running_loop().create_task(listen())
    try:
        return await task
    except asyncio.CancelledError:
        if gone:  # cancelled by the listener, not from outside
            raise ClientDisconnected() from None
        raise
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
