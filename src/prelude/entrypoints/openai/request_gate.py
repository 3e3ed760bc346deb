"""The request gate at the HTTP door: a bound on requests waiting to start (429), refusal while
draining (503), and the count of requests in flight that a graceful drain waits for.

Everything here runs on the server's event loop thread, so plain counters suffice: a
check and its reservation happen in one synchronous stretch, with no await between them,
so a burst can not slip past the bound.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from prelude.engine.request import LoraRequest
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.observe import RequestRecord


class Ticket:
    """One HTTP request let through the gate: counted as waiting until its first engine output, and
    as active until its response is done. Both releases are idempotent."""

    def __init__(self, gate: RequestGate) -> None:
        self._gate = gate
        self._waiting = True
        self._active = True

    def started(self) -> None:
        """The engine produced something for this request: it no longer waits."""
        if self._waiting:
            self._waiting = False
            self._gate.waiting -= 1

    def close(self) -> None:
        self.started()
        if self._active:
            self._active = False
            self._gate.active -= 1
            if self._gate.active == 0:
                self._gate.idle.set()


@dataclass
class RequestGate:
    """`max_waiting`: None = unbounded. `retry_after_s` goes into 429's Retry-After header."""

    max_waiting: int | None = None
    retry_after_s: int = 1
    waiting: int = 0
    active: int = 0
    draining: bool = False
    rejected_overload: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> Ticket:
        """Let one request through or raise APIError 429 (full) / 503 (draining)."""
        if self.draining:
            raise APIError("the server is shutting down and accepts no new requests", 503,
                           code="server_shutting_down")
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            self.rejected_overload += 1
            raise APIError(
                f"the server is overloaded: {self.waiting} requests are already waiting "
                f"(--max-waiting-requests {self.max_waiting}); retry later",
                429, code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s)},
            )
        self.waiting += 1
        self.active += 1
        self.idle.clear()
        return Ticket(self)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request let through is in flight; False if `timeout_s` passed first."""
        if self.active == 0:
            return True
        deadline = time.monotonic() + timeout_s
        while self.active > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.idle.wait(), timeout=left)
            except asyncio.TimeoutError:
                return self.active == 0
        return True


class RequestTimeout(APIError):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request did not finish within the server's {seconds:g} s request timeout; "
                         "it was aborted", 408, code="request_timeout")


class GatedEngine:
    """The EngineClient one HTTP request sees: every engine call marks its ticket started
    at the first output, and, with a deadline, is cut off (and so aborted, its blocks
    freed) when the deadline passes. Everything else is the wrapped engine's."""

    def __init__(self, engine: Any, ticket: Ticket, timeout_s: float | None,
                 record: RequestRecord | None = None, lora: LoraRequest | None = None,
                 labels: tuple[str, ...] | None = None) -> None:
        self._engine = engine
        # The LoRA adapter the request's `model` named: every engine call runs with it.
        self._lora = {"lora": lora} if lora is not None else {}
        self._model_name = lora.name if lora is not None else None
        self._labels = labels  # the adapter's classification labels (None: the engine's)
        self._ticket = ticket
        self._record = record
        self._t0 = time.monotonic()
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def model_name(self) -> str:
        """What answers name as their model: the adapter, or the base."""
        return self._model_name or self._engine.model_name

    @property
    def labels(self) -> tuple[str, ...]:
        return self._engine.labels if self._labels is None else self._labels

    def validate(self, prompt_token_ids: list[int], params: Any, pooling: Any = None) -> None:
        self._engine.validate(prompt_token_ids, params, pooling, **self._lora)

    def _saw(self, out: Any, first: bool) -> None:
        """Count one engine output into the request's log record."""
        self._ticket.started()
        r = self._record
        if r is None:
            return
        if out.exec_class is not None:  # the class validation picked (--force-paged-path included)
            r.saw_class(out.exec_class.value)
        if r.first_output_s is None:
            r.first_output_s = time.monotonic() - self._t0
        if first:
            r.prompt_tokens += out.num_prompt_tokens
        r.output_tokens += len(out.new_token_ids)

    def _left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any) -> AsyncIterator[Any]:
        stream = self._engine.generate(request_id, prompt_token_ids, params, **self._lora)
        first = True
        try:
            if self._deadline is None:  # no --request-timeout: a plain loop, no wait_for per token
                async for out in stream:
                    self._saw(out, first)
                    first = False
                    yield out
                return
            while True:
                left = self._left()
                try:
                    if left is None:
                        out = await stream.__anext__()
                    else:
                        out = await asyncio.wait_for(stream.__anext__(), timeout=left)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise RequestTimeout(self._timeout_s or 0.0) from None
                self._saw(out, first)
                first = False
                yield out
        finally:
            await stream.aclose()  # early close aborts the engine request

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling: Any) -> Any:
        try:
            left = self._left()
            if left is None:
                out = await self._engine.encode(request_id, prompt_token_ids, pooling, **self._lora)
            else:
                try:
                    out = await asyncio.wait_for(self._engine.encode(request_id, prompt_token_ids, pooling,
                                                                     **self._lora), left)
                except asyncio.TimeoutError:
                    raise RequestTimeout(self._timeout_s or 0.0) from None
        finally:
            self._ticket.started()
        self._saw(out, True)
        return out
