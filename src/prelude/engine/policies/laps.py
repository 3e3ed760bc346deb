"""Length-aware prefill (LAPS) with Adaptive Wait-Depth batching for short prompts.

Prompts are split at a boundary L_m into a short queue and a long queue, and a step
advances one kind only (temporal disaggregation; decode rows still ride along):
- short prefills are batched by Adaptive Wait-Depth: wait up to a window W for a
  target depth D (both aligned to power-of-two shape buckets and adapted after each
  dispatch), dispatching at once when a request's TTFT deadline gets near; in
  deadline-free mode a batch also goes when it holds enough tokens;
- long prefills advance one request at a time by fixed chunks.
L_m is a flag, or fitted at run time from measured prefill step times with
T(L, H) = a*L*(L + 2H) + b*L + g*H + c (the paper's b*L and gw*L terms share one
coefficient here: both are linear in L): the boundary is where attention's quadratic
cost reaches the linear cost, a*L^2 = b*L.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from prelude.engine.policies.base import PrefillChoice, Remaining, by_arrival
from prelude.engine.request import Request

LENGTH_BUCKETS = (8, 16, 32, 64, 128, 256)
DEPTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def length_bucket(n: int) -> int:
    return next((b for b in LENGTH_BUCKETS if n <= b), LENGTH_BUCKETS[-1])


def depth_floor(d: int, buckets: tuple[int, ...] = DEPTH_BUCKETS) -> int:
    return max((b for b in buckets if b <= max(1, d)), default=buckets[0])


def depth_above(d: int, buckets: tuple[int, ...] = DEPTH_BUCKETS) -> int:
    return next((b for b in buckets if b > d), buckets[-1])


class StepTimeModel:
    """Least-squares fit of prefill step time over a window of recent steps."""

    def __init__(self, window: int = 256) -> None:
        self._x: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self.coef: np.ndarray | None = None  # a, b, g, c

    def add(self, rows: list[tuple[int, int]], seconds: float) -> None:
        quad = float(sum(L * (L + 2 * H) for L, H in rows))
        self._x.append((quad, float(sum(L for L, _ in rows)), float(sum(H for _, H in rows)), 1.0))
        self._y.append(seconds)
        if len(self._y) >= 8:
            coef, *_ = np.linalg.lstsq(np.array(self._x), np.array(self._y), rcond=None)
            self.coef = coef

    def boundary(self) -> float | None:
        if self.coef is None or self.coef[0] <= 0 or self.coef[1] <= 0:
            return None
        return float(self.coef[1] / self.coef[0])


@dataclass
class AWDState:
    window_s: float
    depth: int
    service_s: float  # estimated duration of one short-prefill step


class LAPSPrefill:
    name = "laps"

    def __init__(
        self,
        boundary: int | None = 256,  # None: fitted at run time (starts at 256)
        long_chunk: int = 512,
        window_bounds_s: tuple[float, float] = (0.002, 0.05),
        initial_depth: int = 8,
        slack_s: float = 0.01,
        deadline_free: bool = False,
        min_batch_tokens: int = 512,  # deadline-free mode: dispatch once a batch holds this many
        boundary_bounds: tuple[int, int] = (64, 2048),
        depth_buckets: tuple[int, ...] = DEPTH_BUCKETS,  # the executor's graph batch sizes when it has graphs
    ) -> None:
        self.fixed_boundary = boundary
        self.depth_buckets = tuple(sorted(depth_buckets))
        self.boundary = boundary or 256
        self.long_chunk = long_chunk
        self.w_min, self.w_max = window_bounds_s
        self.slack_s = slack_s
        self.deadline_free = deadline_free
        self.min_batch_tokens = min_batch_tokens
        self.boundary_bounds = boundary_bounds
        self.awd = AWDState(window_s=self.w_min, depth=depth_floor(initial_depth, self.depth_buckets), service_s=0.05)
        self.model = StepTimeModel()
        self.dispatches: list[tuple[int, str]] = []  # (depth, reason) of recent short dispatches

    # --- ordering ---------------------------------------------------------------------

    def is_short(self, r: Request, remaining: Remaining) -> bool:
        return remaining(r) <= self.boundary

    def order(self, requests: Sequence[Request], now: float, remaining: Remaining) -> list[Request]:
        ordered = by_arrival(requests)
        return [r for r in ordered if self.is_short(r, remaining)] + [r for r in ordered if not self.is_short(r, remaining)]

    # --- Adaptive Wait-Depth --------------------------------------------------------

    def _window(self, shorts: Sequence[Request], now: float) -> float:
        deadlines = [r.ttft_deadline for r in shorts if r.ttft_deadline is not None]
        if deadlines and not self.deadline_free:  # the SLA window: the last safe moment to wait
            return min(max(min(deadlines) - now - self.awd.service_s, self.w_min), self.w_max)
        return self.awd.window_s

    def ready(self, shorts: Sequence[Request], now: float, remaining: Remaining) -> str | None:
        """Why the short batch should go now, or None to keep waiting."""
        if not shorts:
            return None
        if len(shorts) >= self.awd.depth:
            return "depth"
        if not self.deadline_free and any(
            r.ttft_deadline is not None and r.ttft_deadline - (now + self.awd.service_s) <= self.slack_s for r in shorts
        ):
            return "deadline"
        if self.deadline_free and sum(remaining(r) for r in shorts) >= self.min_batch_tokens:
            return "tokens"
        if now - min(r.arrival_time for r in shorts) >= self._window(shorts, now):
            return "window"
        return None

    def _pick(self, shorts: list[Request], remaining: Remaining, budget: int) -> list[Request]:
        """Bucket-first: the oldest request's length bucket, then the nearest buckets."""
        anchor = length_bucket(remaining(shorts[0]))
        ranked = sorted(shorts, key=lambda r: (abs(length_bucket(remaining(r)) - anchor), r.arrival_time))
        batch, tokens = [], 0
        for r in ranked:
            if len(batch) >= self.awd.depth:
                break
            if batch and tokens + remaining(r) > budget:
                continue
            batch.append(r)
            tokens += remaining(r)
        return batch

    def _adapt(self, batch: list[Request], now: float) -> None:
        d = len(batch)
        fill = now - min(r.arrival_time for r in batch)
        if d >= self.awd.depth:
            # Reached the target: wait about as long as that took, and aim one bucket higher
            # if it filled within the window.
            if fill < self.awd.window_s:
                self.awd.depth = depth_above(self.awd.depth, self.depth_buckets)
            self.awd.window_s = min(max(fill, self.w_min), self.w_max)
        else:
            self.awd.depth = depth_floor(d, self.depth_buckets)

    def plan(self, requests: Sequence[Request], now: float, remaining: Remaining, budget: int) -> list[PrefillChoice]:
        ordered = by_arrival(requests)
        shorts = [r for r in ordered if self.is_short(r, remaining)]
        longs = [r for r in ordered if not self.is_short(r, remaining)]
        reason = self.ready(shorts, now, remaining)
        if reason is not None:
            batch = self._pick(shorts, remaining, budget)
            self._adapt(batch, now)
            self.dispatches.append((len(batch), reason))
            del self.dispatches[:-64]
            return [PrefillChoice(r) for r in batch]
        if longs:
            # An in-progress long prompt keeps its chunks flowing before a new one starts.
            longs.sort(key=lambda r: (r.num_computed_tokens == 0, r.arrival_time))
            return [PrefillChoice(longs[0], max_tokens=self.long_chunk)]
        return []  # short prompts are waiting for their window or depth

    # --- measurements ---------------------------------------------------------------

    def observe_step(self, rows: list[tuple[int, int]], seconds: float) -> None:
        if not rows:
            return
        self.model.add(rows, seconds)
        if all(L <= self.boundary for L, _ in rows):
            self.awd.service_s = 0.8 * self.awd.service_s + 0.2 * seconds
        if self.fixed_boundary is None:
            fitted = self.model.boundary()
            if fitted is not None:
                lo, hi = self.boundary_bounds
                self.boundary = int(min(max(fitted, lo), hi))
