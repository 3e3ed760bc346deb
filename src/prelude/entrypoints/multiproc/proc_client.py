"""The EngineClient of one HTTP process when the engine runs in another process.

Validation happens here (ValidatingFront: the same checks as the engine's), so a bad
request is a 400 without a hop; the prepared Request crosses the wire once, and its
increments come back on the same connection. The engine process's end of the connection
closing means it died: every request waiting here fails with EngineDeadError (503), new
ones are refused, and `on_dead` tells the server to exit non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from typing import Any, AsyncIterator, Callable

from prelude.engine.errors import EngineDeadError
from prelude.engine.metrics import RequestMetrics
from prelude.engine.remote import ReplicaInfo, ValidatingFront
from prelude.engine.request import PoolingParams, Request, RequestOutput, SamplingParams
from prelude.entrypoints.multiproc.wire import (
    Abort,
    Add,
    Call,
    Codec,
    Failed,
    Outputs,
    Reply,
    ToFront,
    exception_of,
    read_frame,
)

logger = logging.getLogger("prelude.front")


class ProcEngineClient(ValidatingFront):
    def __init__(self, info: ReplicaInfo, conn: socket.socket, index: int = 0, count: int = 1, seed: int = 0,
                 engine_pid: int | None = None) -> None:
        # Each HTTP process draws unseeded requests' seeds from its own stream.
        super().__init__(info, seed=seed * 1_000_003 + index)
        self.index, self.count, self.engine_pid = index, count, engine_pid
        self._conn = conn
        self._codec = Codec(ToFront)
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._dead: str | None = None
        self._metrics: dict[str, float] = {}
        self._request_metrics: list[RequestMetrics] = []
        self.on_dead: Callable[[], None] | None = None

    async def start(self) -> None:
        """Attach the connection to the running event loop (the server's)."""
        reader, self._writer = await asyncio.open_unix_connection(sock=self._conn)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    # --- the connection ------------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = self._codec.decode(await read_frame(reader))
                if isinstance(message, Outputs):
                    for out in message.items:
                        queue = self._streams.get(out.request_id)
                        if queue is not None:  # else: the caller left; its Abort is on the way
                            queue.put_nowait(out)
                elif isinstance(message, Failed):
                    queue = self._streams.get(message.request_id)
                    if queue is not None:
                        queue.put_nowait(exception_of(message))
                elif isinstance(message, Reply):
                    future = self._calls.pop(message.call_id, None)
                    if future is not None and not future.done():
                        if message.error is None:
                            future.set_result(message.result)
                        else:
                            future.set_exception(RuntimeError(message.error))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._engine_died(f"the engine process closed its connection ({type(exc).__name__})")
        except Exception as exc:  # noqa: BLE001 - a broken wire is as fatal as a dead engine
            logger.exception("reading from the engine process failed")
            self._engine_died(f"reading from the engine process failed: {exc}")

    def _engine_died(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        logger.error("%s: failing %d requests and exiting", reason, len(self._streams))
        error = EngineDeadError(f"the engine process has stopped: {reason}")
        for queue in self._streams.values():
            queue.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        if self.on_dead is not None:
            self.on_dead()

    def _send(self, message: Any) -> None:
        assert self._writer is not None, "start() was not awaited"
        self._writer.write(self._codec.frame(message))

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine process has stopped: {self._dead}")

    async def _call(self, method: str) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(Call(call_id, method))
        return await future

    # --- EngineClient ----------------------------------------------------------------------

    async def _run(self, req: Request) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        rid = req.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[rid] = queue
        self._send(Add(req))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and self._dead is None:
                self._send(Abort(rid))  # client gone or timed out: free its blocks

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        return self._run(self._prepare(request_id, prompt_token_ids, params, None))  # InvalidRequestError here

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams) -> RequestOutput:
        stream = self._run(self._prepare(request_id, prompt_token_ids, SamplingParams(max_tokens=0), pooling))
        try:
            async for out in stream:
                if out.finished:
                    return out
        finally:
            await stream.aclose()
        raise RuntimeError(f"request {request_id} ended without a result")

    async def abort(self, request_id: str) -> None:
        if self._dead is None and self._writer is not None:
            self._send(Abort(request_id))

    def fail_all(self, error: BaseException) -> int:
        """End every request of this process with `error` (a drain past its timeout) and
        abort it in the engine."""
        for rid, queue in self._streams.items():
            queue.put_nowait(error)
            if self._dead is None:
                self._send(Abort(rid))
        return len(self._streams)

    def is_healthy(self) -> bool:
        return self._dead is None

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "api_server": self.index, "api_servers": self.count, "engine_pid": self.engine_pid}

    async def refresh_metrics(self) -> None:
        """Fetch the engine's counters, which metrics() then returns (scrapes are async, metrics() is not)."""
        self._metrics = await self._call("metrics")

    async def refresh_request_metrics(self) -> None:
        self._request_metrics = [RequestMetrics(**m) for m in await self._call("request_metrics")]

    def metrics(self) -> dict[str, float]:
        return self._metrics

    def request_metrics(self) -> list[RequestMetrics]:
        return self._request_metrics

    async def integrity(self) -> dict[str, object]:
        return await self._call("integrity")

    def shutdown(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()
        else:
            self._conn.close()
