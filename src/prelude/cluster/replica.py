"""One engine replica: an AsyncEngine inside a Ray actor.

The front validates a request once (which also fixes its sampling seed) and ships the
prepared Request; the replica enqueues it as is. Outputs stream back
through a Ray streaming generator; cancelling that generator (the client went away)
cancels the coroutine here, whose cleanup aborts the request and frees its blocks. Each
call carries the front's ticket, by which the front also abandons it (call_ledger.py):
Ray's cancel misses a call that has not begun yet.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from typing import AsyncIterator, Callable

import torch

from prelude.cluster.call_ledger import CallLedger
from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.engine.handoff import KVHandoff
from prelude.engine.metrics import RequestMetrics
from prelude.engine.remote import ReplicaInfo, bind_prepared, replica_info  # noqa: F401 - re-exported
from prelude.engine.request import Request, RequestOutput
from prelude.heap import freeze_startup_heap

EngineFactory = Callable[[], LLMEngine]


class EngineReplica:
    """The Ray actor class (wrapped with ray.remote by the launcher, so this module
    imports without starting anything)."""

    def __init__(self, factory: EngineFactory, index: int, threads: int | None, seed: int = 0) -> None:
        def build() -> LLMEngine:
            if threads:  # torch's thread team belongs to the thread that runs the forwards
                torch.set_num_threads(threads)
            return factory()

        self.index = index
        self.front = AsyncEngine(build)  # returns once the engine is built
        self._in_flight = 0
        self._calls = CallLedger()
        # A replica is a process of its own (a Ray worker): loaded, its full collections
        # skip the model and engine, as `prelude serve`'s do (heap.py says why).
        freeze_startup_heap()

    def info(self) -> ReplicaInfo:
        return replica_info(self.front.engine)

    def ping(self) -> int:
        """Answers once the actor is up (after a restart too): Ray's own liveness, used
        by the front to learn that a restarted replica is back."""
        return os.getpid()

    def check_adapter(self, lora: LoraRequest) -> tuple[str, ...]:
        """Read and check a LoRA adapter against this replica's model (ValueError saying why)."""
        return self.front.engine.check_adapter(lora)

    def _bind(self, req: Request) -> Request:
        return bind_prepared(self.front.engine, req)

    async def generate(self, req: Request, ticket: str) -> AsyncIterator[RequestOutput]:
        """Stream a prepared request's increments. A cancelled stream (Ray cancels this
        coroutine when the front drops it) aborts the request in AsyncEngine.submit; so
        does `abandon(ticket)`, where Ray's cancel came before the call began."""
        async for out in self._call(ticket, lambda: self.front.submit(self._bind(req))):
            yield out  # type: ignore[misc]

    async def prefill(self, req: Request, ticket: str) -> AsyncIterator[RequestOutput | KVHandoff]:
        """Disaggregated prefill: the first-token increment, then (unless that token
        finished the request) its KVHandoff, which Ray stores once in its object store;
        the front passes that object's reference to a decode replica without reading it."""
        async for item in self._call(ticket, lambda: self.front.submit(replace(self._bind(req), hand_off=True))):
            yield item

    async def decode(self, handoff: KVHandoff, ticket: str) -> AsyncIterator[RequestOutput]:
        """Disaggregated decode: import a request's KV (Ray fetched the hand-off from the
        object store) and stream its increments after the first token."""
        async for out in self._call(ticket, lambda: self.front.resume(handoff)):
            yield out  # type: ignore[misc]

    async def _call(
        self, ticket: str, start: Callable[[], AsyncIterator[RequestOutput | KVHandoff]],
    ) -> AsyncIterator[RequestOutput | KVHandoff]:
        task = asyncio.current_task()
        assert task is not None  # Ray drives a streamed call in a task of the actor's loop
        if not self._calls.begin(ticket, task):
            return  # abandoned by the front before it began: submit nothing
        self._in_flight += 1
        stream = start()
        try:
            async for item in stream:
                yield item
        finally:
            try:
                await stream.aclose()  # an unfinished request's abort is queued before in_flight drops
            finally:
                self._in_flight -= 1
                self._calls.end(ticket)

    async def abandon(self, ticket: str) -> None:
        """The front no longer reads call `ticket` (see call_ledger.py)."""
        task = self._calls.abandon(ticket)
        if task is not None:
            task.cancel()  # as Ray's cancel: the call's cleanup aborts its request

    async def abort(self, request_id: str) -> None:
        await self.front.abort(request_id)

    def load(self) -> dict[str, float]:
        m = self.front.metrics()
        return {"in_flight": float(self._in_flight), "running": m["requests_running"], "waiting": m["requests_waiting"]}

    def metrics(self) -> dict[str, float]:
        return {**self.front.metrics(), "in_flight": float(self._in_flight)}

    def request_metrics(self) -> list[RequestMetrics]:
        return self.front.request_metrics()

    async def check_integrity(self, timeout_s: float = 10.0) -> None:
        """The KV bookkeeping check, once the engine has no work (it reads the pool from
        this thread, so it waits for the engine thread to go idle)."""
        deadline = time.monotonic() + timeout_s
        while self.front.engine.has_unfinished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.index} still has unfinished requests")
            await asyncio.sleep(0.02)
        self.front.engine.check_integrity()
