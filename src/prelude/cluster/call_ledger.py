"""A replica's record of the front's streamed calls, by ticket, so that a call the front
abandoned ends even when Ray's cancel missed it.

The front cancels a replica call it no longer reads with `ray.cancel`. Ray delivers that
as an asyncio cancel only once the call's coroutine exists: a cancel that arrives while
the call still waits to start is lost (ray-project/ray#52628): under load a decode call
can start long after its stream was abandoned and then decode all of its tokens for no one. So the front also sends `abandon(ticket)`: it cancels the task
of a call that runs, as Ray's cancel would have (the call's cleanup aborts its request),
and marks a ticket whose call has not begun, which then ends before it submits anything.
A ticket names one call, not a request: a request that runs again (a lost hand-off, a
retry) comes with a new ticket and is not refused.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

REMEMBERED_ABANDONED = 4096  # tickets of abandoned calls that never began (each a few dozen bytes)


class CallLedger:
    """Used from the replica's event loop only (no lock)."""

    def __init__(self, remembered: int = REMEMBERED_ABANDONED) -> None:
        self._live: dict[str, asyncio.Task[Any]] = {}  # ticket -> the task running its call
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # tickets abandoned before their call began
        self._remembered = remembered

    def begin(self, ticket: str, task: asyncio.Task[Any]) -> bool:
        """A call starts in `task`: False when its front abandoned it already (the call
        must end now)."""
        if ticket in self._abandoned:
            del self._abandoned[ticket]
            return False
        self._live[ticket] = task
        return True

    def end(self, ticket: str) -> None:
        self._live.pop(ticket, None)

    def abandon(self, ticket: str) -> asyncio.Task[Any] | None:
        """The front left this call: the task to cancel when it runs, else None (the
        ticket is kept, the oldest forgotten past the bound: a call that ended on its own
        before the front's word came is never looked up again)."""
        task = self._live.pop(ticket, None)
        if task is None:
            self._abandoned[ticket] = None
            while len(self._abandoned) > self._remembered:
                self._abandoned.popitem(last=False)
        return task

    @property
    def live(self) -> int:
        return len(self._live)
