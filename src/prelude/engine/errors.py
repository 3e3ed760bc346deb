"""Failures the engine reports to its callers (the async front, the offline API)."""

from __future__ import annotations


class StepFailed(RuntimeError):
    """A model step raised. Only the requests of that step were failed; their KV blocks
    (and a OneShot step's holds) are already released, the rest of the engine is intact."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served (HTTP 503, /health unhealthy)."""
