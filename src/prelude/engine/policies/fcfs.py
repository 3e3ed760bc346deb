"""First come, first served, for prefills and decodes."""

from __future__ import annotations

from typing import Sequence

from prelude.engine.policies.base import OrderOnlyPrefill, Remaining, by_arrival
from prelude.engine.request import Request


class FCFSPrefill(OrderOnlyPrefill):
    name = "fcfs"

    def order(self, requests: Sequence[Request], now: float, remaining: Remaining) -> list[Request]:
        return by_arrival(requests)


class FCFSDecode:
    name = "fcfs"

    def order(self, running: Sequence[Request], now: float) -> list[Request]:
        return by_arrival(running)

    def on_step(self, served: Sequence[Request], not_served: Sequence[Request], now: float) -> None:
        return None
