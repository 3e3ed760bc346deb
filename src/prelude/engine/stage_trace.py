"""Where one request's host time goes: in-process stage timestamps, off unless asked for.

`prelude serve --trace-stages` opens a StageTrace per HTTP request (the server's
RequestObserver) and puts it in the `current` context variable, which every coroutine
and worker thread of that request's handler sees. The code on the request's path marks
the end of each stage it runs; the engine thread marks the stages it runs on a traced
Request's `trace`. Off (the default) nothing is created and each mark site is one
`is not None` test; the engine does not even look for traced rows until it has seen one.

A mark names the stage that just ended; a stage's time is its mark's time minus the
previous mark's. Stages that repeat (one per decode step) add up.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

# In the order one OneShot request passes through them.
STAGES = (
    "http_parse_validate",  # ASGI entry -> the handler runs (routing, JSON, pydantic)
    "tokenize",  # prompt text -> ids
    "validate",  # sampling params, limits, request rules, the Request built
    "hop_to_engine",  # the inbox: caller thread -> engine thread
    "wait_for_step",  # on the engine thread until a step starts that takes it
    "schedule",  # that step's schedule()
    "forward",  # inputs built, the model run (launched, on an asynchronous device)
    "sample",  # logits, sampling, heads, the results on the host
    "detokenize",  # post-processing: text, stop checks, the RequestOutput built
    "hop_back",  # engine thread -> the handler's event loop
    "serialize",  # the response body built and sent
)


class StageTrace:
    """Timestamps of one request's stage ends (perf_counter seconds)."""

    __slots__ = ("started", "marks")

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.marks: list[tuple[str, float]] = []

    def mark(self, stage: str, at: float | None = None) -> None:
        self.marks.append((stage, time.perf_counter() if at is None else at))

    def stages(self) -> dict[str, float]:
        """Seconds per stage, summed over repeats, in the order first seen."""
        out: dict[str, float] = {}
        last = self.started
        for stage, at in sorted(self.marks, key=lambda m: m[1]):
            out[stage] = out.get(stage, 0.0) + max(0.0, at - last)
            last = at
        return out

    @property
    def total(self) -> float:
        return max((at for _, at in self.marks), default=self.started) - self.started


current: ContextVar[StageTrace | None] = ContextVar("prelude_stage_trace", default=None)


def mark(stage: str) -> None:
    """Mark `stage` on the current request's trace, if it has one."""
    trace = current.get()
    if trace is not None:
        trace.mark(stage)
