"""Policies decide the order of work only; the scheduler decides what fits the budgets.

A scheduling policy is a pair: a prefill policy (which prompts to advance next, and in
what chunks) and a decode policy (which running sequences get this step's decode slots,
and who is preempted first when KV runs out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from prelude.engine.request import Request

# Tokens a prefill still has to compute, net of its cached prefix (given by the scheduler).
Remaining = Callable[[Request], int]


@dataclass(frozen=True)
class PrefillChoice:
    request: Request
    max_tokens: int | None = None  # a chunk cap for this step (None: the token budget decides)


class PrefillPolicy(Protocol):
    name: str

    def order(self, requests: Sequence[Request], now: float, remaining: Remaining) -> list[Request]:
        """Requests whose prompts need computing, the first to serve first."""
        ...

    def plan(self, requests: Sequence[Request], now: float, remaining: Remaining, budget: int) -> list[PrefillChoice]:
        """What to advance this step (may hold work back, e.g. to batch it better)."""
        ...

    def observe_step(self, rows: list[tuple[int, int]], seconds: float) -> None:
        """A finished prefill step: (new tokens L, cached history H) per row, and its time."""
        ...


class DecodePolicy(Protocol):
    name: str

    def order(self, running: Sequence[Request], now: float) -> list[Request]:
        """Decoding requests, the first to serve first; the last is preempted first."""
        ...

    def on_step(self, served: Sequence[Request], not_served: Sequence[Request], now: float) -> None:
        """Bookkeeping after a step (quanta, starvation counters)."""
        ...


@dataclass(frozen=True)
class SchedulingPolicy:
    prefill: PrefillPolicy
    decode: DecodePolicy

    @property
    def name(self) -> str:
        return f"{self.prefill.name}+{self.decode.name}"


def by_arrival(requests: Sequence[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_time)


class OrderOnlyPrefill:
    """Mixin: `plan` takes everything in `order`, the budget decides the rest."""

    def plan(self, requests: Sequence[Request], now: float, remaining: Remaining, budget: int) -> list[PrefillChoice]:
        return [PrefillChoice(r) for r in self.order(requests, now, remaining)]  # type: ignore[attr-defined]

    def observe_step(self, rows: list[tuple[int, int]], seconds: float) -> None:
        return None
