"""The engine process: one AsyncEngine (its step loop on its own thread) behind a Unix
socket that the HTTP processes connect to, one connection each.

Each prepared request runs as a task over AsyncEngine.submit, as in a Ray replica;
cancelling the task (an Abort frame, or its HTTP process gone) aborts the request and
frees its blocks. Increments produced during one turn of this process's event loop go
back to an HTTP process as one frame. Finished requests and steps are observed here, into
Prometheus's multiprocess files, which every HTTP process's /metrics aggregates.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any

from prelude.config import EngineConfig
from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.engine.remote import bind_prepared, replica_info
from prelude.engine.request import Request, RequestOutput
from prelude.entrypoints.multiproc.wire import (
    Abort,
    Add,
    Call,
    Codec,
    Outputs,
    Reply,
    ToEngine,
    failure,
    raw_frame,
    read_frame,
)
from prelude.heap import freeze_startup_heap

logger = logging.getLogger("prelude.engine_proc")

# How often the process checks that its engine loop still runs (a dead loop ends the process).
_HEALTH_POLL_S = 0.5


class _FrontConnection:
    """One HTTP process's connection: its requests in flight and its output batch."""

    def __init__(self, engine: AsyncEngine, writer: asyncio.StreamWriter) -> None:
        self._engine = engine
        self._writer = writer
        self._codec = Codec(ToEngine)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._batch: list[RequestOutput] = []
        self._loop = asyncio.get_running_loop()

    def send_info(self, info: bytes) -> None:
        self._writer.write(raw_frame(info))

    def handle(self, payload: bytes) -> None:
        message = self._codec.decode(payload)
        if isinstance(message, Add):
            rid = message.req.request_id
            self._tasks[rid] = self._loop.create_task(self._run(message.req))
        elif isinstance(message, Abort):
            task = self._tasks.pop(message.request_id, None)
            if task is not None:
                task.cancel()  # AsyncEngine.submit's cleanup aborts it in the engine
        elif isinstance(message, Call):
            self._loop.create_task(self._answer(message))

    async def _run(self, req: Request) -> None:
        rid = req.request_id
        try:
            stream = self._engine.submit(bind_prepared(self._engine.engine, req))
            async for out in stream:
                assert isinstance(out, RequestOutput)  # no hand-off: hand_off is never set here
                if not self._batch:
                    self._loop.call_soon(self._flush)
                self._batch.append(out)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - reported to that request's HTTP process
            self._flush()  # what it produced before the error goes first
            self._write(self._codec.frame(failure(rid, exc)))
        finally:
            self._tasks.pop(rid, None)

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._write(self._codec.frame(Outputs(batch)))

    def _write(self, frame: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(frame)

    async def _answer(self, call: Call) -> None:
        try:
            result = await self._call(call.method)
            reply = Reply(call.call_id, result)
        except Exception as exc:  # noqa: BLE001 - the caller's error
            reply = Reply(call.call_id, None, f"{type(exc).__name__}: {exc}")
        self._write(self._codec.frame(reply))

    async def _call(self, method: str) -> Any:
        if method == "metrics":
            return self._engine.metrics()
        if method == "request_metrics":
            return [m._asdict() for m in self._engine.request_metrics()]
        if method == "integrity":
            return await self._engine.integrity()
        raise ValueError(f"unknown call {method!r}")

    def close(self) -> None:
        """The HTTP process is gone: abort everything it had in flight."""
        for task in list(self._tasks.values()):
            task.cancel()
        self._tasks.clear()


class EngineService:
    def __init__(self, engine: AsyncEngine, path: str) -> None:
        self.engine = engine
        self.path = path
        self._info = pickle.dumps(replica_info(engine.engine, with_tokenizer=False))
        self._stop = asyncio.Event()
        self.exit_code = 0

    async def _serve_front(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _FrontConnection(self.engine, writer)
        conn.send_info(self._info)
        try:
            while True:
                conn.handle(await read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the HTTP process closed its end (exit, or death)
        finally:
            conn.close()
            writer.close()

    async def _watch_engine(self) -> None:
        while not self._stop.is_set():
            if not self.engine.is_healthy():
                logger.error("the engine loop stopped; the engine process exits so the HTTP processes fail fast")
                self.exit_code = 1
                self._stop.set()
                return
            await asyncio.sleep(_HEALTH_POLL_S)

    def stop(self) -> None:
        self._stop.set()

    async def run(self, ready: Connection) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        server = await asyncio.start_unix_server(self._serve_front, self.path)
        watcher = loop.create_task(self._watch_engine())
        ready.send(("ready", os.getpid()))
        ready.close()
        await self._stop.wait()
        watcher.cancel()
        server.close()
        return self.exit_code


def _event_loop_runner() -> Any:
    """uvloop's when installed, as uvicorn picks for the HTTP processes (fewer microseconds per hop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def engine_main(config: EngineConfig, path: str, ready: Connection, log_level: str, log_format: str) -> None:
    """The engine process's entry (multiprocessing spawn target)."""
    from prelude.entrypoints.multiproc.child import child_setup
    from prelude.entrypoints.openai.prom import ServerMetrics

    child_setup(log_level, log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the engine stops
    try:
        engine = AsyncEngine(lambda: LLMEngine.from_config(config))
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, which exits non-zero
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    engine.set_observer(ServerMetrics(engine))  # multiprocess mode: the HTTP processes read these
    service = EngineService(engine, path)
    freeze_startup_heap()  # the model and engine are loaded: full collections skip them
    try:
        code = _event_loop_runner()(service.run(ready))
    finally:
        engine.shutdown()
    raise SystemExit(code)
