"""Multi-level feedback queue for decodes (Prophet / FastServe style).

New sequences enter level 0. Each level has a quantum of decode iterations; a sequence
that spends its quantum drops one level. Lower levels are served after higher ones, so
long generations yield their decode slots to short ones. A sequence that has not been
served for `starvation_steps` consecutive steps goes back to level 0.
"""

from __future__ import annotations

from typing import Sequence

from prelude.engine.request import Request

DEFAULT_QUANTA = (25, 50, 100, 200, 400)


class MLFQDecode:
    name = "mlfq"

    def __init__(self, quanta: Sequence[int] = DEFAULT_QUANTA, starvation_steps: int = 200) -> None:
        self.quanta = tuple(quanta)
        self.starvation_steps = starvation_steps

    def order(self, running: Sequence[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: (r.mlfq_level, r.arrival_time))

    def on_step(self, served: Sequence[Request], not_served: Sequence[Request], now: float) -> None:
        for r in served:
            r.mlfq_starved_steps = 0
            r.mlfq_used += 1
            if r.mlfq_used >= self.quanta[r.mlfq_level] and r.mlfq_level < len(self.quanta) - 1:
                r.mlfq_level += 1  # quantum spent: demote
                r.mlfq_used = 0
        for r in not_served:
            r.mlfq_starved_steps += 1
            if r.mlfq_starved_steps >= self.starvation_steps:
                r.mlfq_level, r.mlfq_used, r.mlfq_starved_steps = 0, 0, 0  # starving: promote to the top
