"""Graceful drain on SIGTERM / SIGINT: stop admitting (new requests get 503), let the
requests in flight finish within the shutdown timeout, end the rest with an explicit
error (an error body, or an error event on a stream), then exit 0. A second signal (the
impatient second Ctrl+C) ends the requests in flight with that error at once and stops."""

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
# After a second signal: the same, and the app's own shutdown, get this long.
_STOP_FLUSH_S = 1.0


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
        self._stopping = False  # a second signal's stop is under way

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self._draining:  # a second signal: stop now
            if self._loop is None or self._stopping:  # no loop to flush through, or a third signal
                self.force_exit = self.should_exit = True
                return
            self._stopping = True
            logger.warning("second %s: stopping now, %d requests in flight end with an error", name, self.gate.active)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.stop_now(name)))
            return
        self._draining = True
        self.gate.draining = True  # synchronous: the very next request is refused
        logger.info("%s: draining, %d requests in flight, shutdown timeout %.0f s",
                    name, self.gate.active, self.timeout_s)
        if self._loop is None:
            self.should_exit = True
            return
        # A signal handler may interrupt the loop anywhere: hand over through its self-pipe.
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    def _end_in_flight(self, message: str) -> int:
        """Every request in flight ends with a 503 `server_shutting_down` (a body, or an
        error event on a stream): how many."""
        fail_all = getattr(self.engine, "fail_all", None)
        return fail_all(APIError(message, 503, code="server_shutting_down")) if fail_all is not None else 0

    async def drain(self) -> None:
        if not await self.gate.wait_idle(self.timeout_s):
            count = self._end_in_flight(f"the server is shutting down and this request did not finish within the "
                                        f"{self.timeout_s:g} s shutdown timeout")
            logger.warning("drain: shutdown timeout passed; %d requests ended with an error", count)
            await self.gate.wait_idle(_FLUSH_S)
        logger.info("drain: done, shutting down")
        self.should_exit = True

    async def stop_now(self, signal_name: str) -> None:
        """After a second signal: the requests in flight get their error answer (uvicorn's
        forced exit would cancel their handlers: a 500 in plain text, a traceback in the log),
        then the server stops without waiting for anything else."""
        self._end_in_flight(f"the server was stopped ({signal_name} twice) before this request finished")
        await self.gate.wait_idle(_STOP_FLUSH_S)
        self.force_exit = self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the app's lifespan shutdown on a forced exit; its task, cancelled
            # when the loop closes, logged a traceback. The app's shutdown is quick here.
            try:
                await asyncio.wait_for(self.lifespan.shutdown(), _STOP_FLUSH_S)
            except asyncio.TimeoutError:
                logger.warning("the app's shutdown took over %.0f s; stopping without it", _STOP_FLUSH_S)
