"""Instance pools: LAPS spatial mode (short and long prefill pools under a pressure
controller) and Prophet's decode placement with backpressure. No Ray here: the Ray
front and the simulator (`prelude bench simulate`) run this same code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

logger = logging.getLogger("prelude.cluster.pools")


@dataclass(frozen=True)
class PoolMove:
    time: float
    instance: int
    src: str
    dst: str
    reason: str


@dataclass(frozen=True)
class PoolConfig:
    boundary: int = 256  # L_m: prompts shorter than this go to the short pool
    ratio_threshold: float = 2.0  # move when one pool's pressure is this many times the other's ...
    min_pressure: float = 0.05  # ... and the busier pool has at least this much queued work per instance (its units)
    cooldown_s: float = 1.0  # at most one move per cooldown (a move takes effect slowly)
    # Pressure is work per instance divided by the pool's scale, e.g. its TTFT SLO: a long
    # pool may hold more queued work than a short one before it is under pressure.
    short_scale: float = 1.0
    long_scale: float = 1.0


class PoolController:
    """Instances split into a `short` and a `long` pool. Pressure of a pool = its queued
    prefill work per instance (seconds from the step-time model in the simulator; prompt
    tokens not yet prefilled in the Ray front, which has no cost model). When one pool's
    pressure exceeds the other's by `ratio_threshold`, the least loaded instance of
    the calmer pool moves over (each pool keeps at least one); every move is logged
    with its reason and kept in `moves`."""

    def __init__(self, config: PoolConfig, short: Sequence[int], long: Sequence[int]) -> None:
        if not short or not long:
            raise ValueError("each LAPS pool needs at least one instance")
        self.config = config
        self.pools: dict[str, list[int]] = {"short": list(short), "long": list(long)}
        self.moves: list[PoolMove] = []
        self._last_move = float("-inf")

    def pool_of(self, prompt_tokens: int) -> str:
        return "short" if prompt_tokens < self.config.boundary else "long"

    def members(self, pool: str) -> list[int]:
        return self.pools[pool]

    def pressure(self, work_s: Sequence[float]) -> dict[str, float]:
        """Queued work per instance of each pool over the pool's scale; `work_s[i]` is instance i's."""
        scale = {"short": self.config.short_scale, "long": self.config.long_scale}
        return {name: sum(work_s[i] for i in ids) / len(ids) / scale[name] for name, ids in self.pools.items()}

    def rebalance(self, now: float, work_s: Sequence[float]) -> PoolMove | None:
        cfg = self.config
        if now - self._last_move < cfg.cooldown_s:
            return None
        p = self.pressure(work_s)
        hot, cold = ("short", "long") if p["short"] >= p["long"] else ("long", "short")
        if p[hot] < cfg.min_pressure or p[hot] < cfg.ratio_threshold * p[cold] or len(self.pools[cold]) < 2:
            return None
        instance = min(self.pools[cold], key=lambda i: work_s[i])
        self.pools[cold].remove(instance)
        self.pools[hot].append(instance)
        self._last_move = now
        move = PoolMove(now, instance, cold, hot,
                        f"{hot} pool pressure {p[hot]:.3g}/instance >= {cfg.ratio_threshold:g} x {cold} pool's "
                        f"{p[cold]:.3g}/instance")
        self.moves.append(move)
        logger.info("LAPS pools: instance %d %s -> %s: %s", instance, cold, hot, move.reason)
        return move


@dataclass
class DecodePlacer:
    """Prophet's hand-off rule: a finished prefill goes to the decode instance holding the
    fewest requests, but never past `max_requests_in_scheduler`; when every decode
    instance is full it waits (backpressure), so a burst can not run decode out of KV."""

    max_requests_in_scheduler: int
    held: list[int] = field(default_factory=list)  # requests each decode instance holds
    waits: int = 0  # hand-offs that found every decode instance full

    def place(self, candidates: Sequence[int] | None = None) -> int | None:
        cands = range(len(self.held)) if candidates is None else candidates
        open_ = [d for d in cands if self.held[d] < self.max_requests_in_scheduler]
        if not open_:
            self.waits += 1
            return None
        d = min(open_, key=lambda i: (self.held[i], i))
        self.held[d] += 1
        return d

    def release(self, d: int) -> None:
        self.held[d] -= 1
