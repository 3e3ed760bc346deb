"""First come, first served: arrival order for admission, newest preempted first."""

from __future__ import annotations

from typing import Sequence

from prelude.engine.request import Request


class FCFSPolicy:
    name = "fcfs"

    def order_waiting(self, waiting: Sequence[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    def order_running(self, running: Sequence[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: r.arrival_time)
