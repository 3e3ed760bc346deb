"""A client that goes away: the work it was waiting for is cancelled, which aborts its
engine requests and frees their KV blocks."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import Request as HTTPRequest

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the answer was ready."""


async def until_disconnect(work: Awaitable[T], http_request: HTTPRequest | None) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the HTTP
    client goes away meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)  # a cheap check: abandoned work stops soon
            if done:
                return task.result()
            if http_request is not None and await http_request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
