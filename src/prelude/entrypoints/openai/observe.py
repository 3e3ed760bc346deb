"""Request ids and one log line (plus one counter increment) per finished HTTP request.

A plain ASGI middleware, outermost but for auth and the body cap: it sees the final
status of every request, streamed ones included (their line is written when the stream
ends), and echoes `X-Request-Id` (the client's, or a fresh one).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prelude.engine import stage_trace

access_logger = logging.getLogger("prelude.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")  # echoed into a header and logs: keep it tame
STATE_KEY = "prelude_record"


@dataclass
class RequestRecord:
    """What one HTTP request did, filled in by the handler and its engine calls."""

    request_id: str
    exec_class: str = "none"  # oneshot | paged (the heaviest class among its sequences) | none
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_output_s: float | None = None  # since the request arrived
    cancelled: bool = False  # the client went away before the answer

    def saw_class(self, exec_class: str) -> None:
        if self.exec_class != "paged":
            self.exec_class = exec_class


def request_record(scope_state: Any) -> RequestRecord | None:
    """The record of the current request (None outside RequestObserver, e.g. in unit tests)."""
    return getattr(scope_state, STATE_KEY, None)


class StageTraces:
    """The stage breakdowns of the last finished traced requests (`--trace-stages`)."""

    def __init__(self, keep: int = 10_000) -> None:
        self._done: deque[dict[str, Any]] = deque(maxlen=keep)

    def add(self, route: str, status: int, trace: stage_trace.StageTrace) -> None:
        self._done.append({"route": route, "status": status, "total_s": trace.total, "stages_s": trace.stages()})

    def take(self) -> list[dict[str, Any]]:
        """Every breakdown kept so far, oldest first; the store is emptied."""
        out = list(self._done)
        self._done.clear()
        return out


class RequestObserver:
    """`count(route, status, exec_class)` is called once per finished request. With
    `traces`, each request runs under a StageTrace (see engine/stage_trace.py) whose
    breakdown is kept there when the response has been sent."""

    def __init__(self, app: ASGIApp, count: Any = None, traces: StageTraces | None = None) -> None:
        self.app = app
        self._count = count
        self._traces = traces

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace = None
        if self._traces is not None:
            trace = stage_trace.StageTrace()
            stage_trace.current.set(trace)  # this request's task (and its children) only
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"").decode("latin-1")
        record = RequestRecord(given if _REQUEST_ID.match(given) else uuid.uuid4().hex)
        scope.setdefault("state", {})[STATE_KEY] = record
        status = 500
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", record.request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            if record.cancelled:
                status = 499
            if trace is not None and trace.marks and self._traces is not None:  # kept: engine-backed routes
                trace.mark("serialize")
                self._traces.add(route, status, trace)
            self._finished(scope, route, status, record, time.perf_counter() - t0)

    def _finished(self, scope: Scope, route: str, status: int, record: RequestRecord, seconds: float) -> None:
        if self._count is not None:
            self._count(route, status, record.exec_class)
        if route in ("/health", "/metrics"):
            return  # probes and scrapes would drown the log
        fields = {
            "request_id": record.request_id, "method": scope.get("method"), "route": route, "status": status,
            "exec_class": record.exec_class, "prompt_tokens": record.prompt_tokens,
            "output_tokens": record.output_tokens,
            "ttft_ms": None if record.first_output_s is None else round(record.first_output_s * 1000, 2),
            "duration_ms": round(seconds * 1000, 2),
        }
        outcome = "cancelled" if status == 499 else "finished"
        access_logger.info(
            "%s %s %s %s %d class=%s prompt_tokens=%d output_tokens=%d ttft_ms=%s duration_ms=%.1f",
            outcome, record.request_id, scope.get("method"), route, status, record.exec_class,
            record.prompt_tokens, record.output_tokens, fields["ttft_ms"], fields["duration_ms"],
            extra={"request": fields},
        )
