"""Shortest remaining prompt first, with starvation prevention (Prophet's prefill order).

Remaining work is the prompt tokens still to compute after the cached prefix. A request
that has waited longer than `starvation_s` jumps to the front (oldest first), so long
prompts are delayed, never starved.
"""

from __future__ import annotations

from typing import Sequence

from prelude.engine.policies.base import OrderOnlyPrefill, Remaining
from prelude.engine.request import Request


class SRPTPrefill(OrderOnlyPrefill):
    name = "srpt"

    def __init__(self, starvation_s: float = 10.0) -> None:
        self.starvation_s = starvation_s

    def order(self, requests: Sequence[Request], now: float, remaining: Remaining) -> list[Request]:
        def key(r: Request) -> tuple[int, float, float]:
            starved = now - r.arrival_time >= self.starvation_s
            return (0, r.arrival_time, 0.0) if starved else (1, float(remaining(r)), r.arrival_time)

        return sorted(requests, key=key)
