"""A policy decides the order of work only; the scheduler decides what fits."""

from __future__ import annotations

from typing import Protocol, Sequence

from prelude.engine.request import Request


class SchedulingPolicy(Protocol):
    name: str

    def order_waiting(self, waiting: Sequence[Request], now: float) -> list[Request]:
        """Waiting requests, the first to admit first."""
        ...

    def order_running(self, running: Sequence[Request], now: float) -> list[Request]:
        """Running requests, the first to serve first; the last is preempted first."""
        ...
