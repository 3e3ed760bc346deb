"""Graceful drain on SIGTERM / SIGINT: stop admitting (new requests get 503), let the
requests in flight finish within the shutdown timeout, end the rest with an explicit
error (an error body, or an error event on a stream), then exit 0."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.request_gate import RequestGate

logger = logging.getLogger("prelude.server")

# After the timeout, the error answers of the requests cut off get this long to go out.
_FLUSH_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain between the signal and uvicorn's own shutdown.

    uvicorn's handle_exit would close the listening socket at once (new clients see a
    refused connection, not a 503) and re-raise the signal after shutdown (exit code
    -15, not 0); this one keeps serving refusals while in-flight requests finish.
    """

    def __init__(self, config: uvicorn.Config, gate: RequestGate, timeout_s: float, engine: Any = None) -> None:
        super().__init__(config)
        self.gate = gate
        self.timeout_s = timeout_s
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:  # a second signal: stop now
            logger.warning("second %s: stopping without waiting", signal.Signals(sig).name)
            self.force_exit = self.should_exit = True
            return
        self._draining = True
        self.gate.draining = True  # synchronous: the very next request is refused
        logger.info("%s: draining, %d requests in flight, shutdown timeout %.0f s",
                    signal.Signals(sig).name, self.gate.active, self.timeout_s)
        if self._loop is None:
            self.should_exit = True
            return
        # A signal handler may interrupt the loop anywhere: hand over through its self-pipe.
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        if not await self.gate.wait_idle(self.timeout_s):
            fail_all = getattr(self.engine, "fail_all", None)
            count = 0
            if fail_all is not None:
                count = fail_all(APIError(
                    f"the server is shutting down and this request did not finish within the "
                    f"{self.timeout_s:g} s shutdown timeout", 503, code="server_shutting_down"))
            logger.warning("drain: shutdown timeout passed; %d requests ended with an error", count)
            await self.gate.wait_idle(_FLUSH_S)
        logger.info("drain: done, shutting down")
        self.should_exit = True
