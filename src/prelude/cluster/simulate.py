"""A discrete-event simulator of many engine instances, for planning past one machine.

Each simulated instance runs the engine's step loop shape (decode rows of the running
requests plus chunked prefill under a token budget) and each step costs what the
fitted step-time model T(L, H) says (engine/policies/laps.py's StepTimeModel, fitted
on this machine). Requests are placed by the real router (cluster/router.py), LAPS
pools by the real PoolController and disaggregated hand-offs by the real DecodePlacer
(cluster/pools.py): the code under test is the code that serves.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from prelude.cluster.pools import DecodePlacer, PoolConfig, PoolController
from prelude.cluster.router import ApproxPrefixTree, Router, RouterConfig


@dataclass(frozen=True)
class StepCost:
    """T(rows) = a*sum L(L+2H) + b*sum L + g*sum H + c, rows = (new tokens L, cached context H)."""

    a: float
    b: float
    g: float
    c: float

    def seconds(self, rows: Sequence[tuple[int, int]]) -> float:
        if not rows:
            return 0.0
        quad = sum(L * (L + 2 * H) for L, H in rows)
        return self.a * quad + self.b * sum(L for L, _ in rows) + self.g * sum(H for _, H in rows) + self.c

    def prefill_seconds(self, L: int, H: int = 0) -> float:
        return self.seconds([(L, H)])

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[tuple[int, int]], float]]) -> "StepCost":
        """Least squares over (rows, seconds) samples; coefficients clipped at zero."""
        x = [[sum(L * (L + 2 * H) for L, H in rows), sum(L for L, _ in rows), sum(H for _, H in rows), 1.0]
             for rows, _ in samples]
        coef, *_ = np.linalg.lstsq(np.array(x, dtype=float), np.array([s for _, s in samples]), rcond=None)
        return cls(*(max(0.0, float(v)) for v in coef))


@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    prompt: tuple[int, ...]
    output_tokens: int
    ttft_slo_s: float


@dataclass(frozen=True)
class SimConfig:
    instances: int = 8
    mode: str = "colocated"  # colocated | disaggregated
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill_policy: str = "fcfs"  # fcfs | srpt (the prefill queue order)
    laps_pools: tuple[int, int] | None = None  # (short, long) prefill instances; None: uniform
    pool_config: PoolConfig = field(default_factory=PoolConfig)
    decode_instances: int = 0  # disaggregated: how many of `instances` decode
    max_requests_in_scheduler: int = 64
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    cache_blocks: int = 4096  # per instance: its real prefix cache (the router only guesses it)
    block_size: int = 16
    handoff_s_per_token: float = 0.0  # KV transfer cost per prompt token (0: shared memory)
    rebalance_every_s: float = 0.25


@dataclass
class _Req:
    trace: TraceRequest
    index: int
    todo: int = 0  # prompt tokens still to prefill
    done: int = 0  # prompt tokens whose KV exists
    emitted: int = 0
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None
    decode_at: int | None = None


@dataclass
class _Instance:
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False
    cache: ApproxPrefixTree | None = None


@dataclass(frozen=True)
class SimResult:
    ttft: list[float]
    tpot: list[float]
    slo_violations: int
    short_ttft: list[float]
    finished: int
    prefix_hit_rate: float
    pool_moves: int
    backpressure_waits: int
    makespan_s: float
    output_tokens: int

    def summary(self) -> dict[str, float]:
        def pct(xs: list[float], q: float) -> float:
            return float(np.percentile(xs, q)) if xs else float("nan")

        return {
            "finished": self.finished,
            "ttft_p50_s": pct(self.ttft, 50), "ttft_p90_s": pct(self.ttft, 90), "ttft_p99_s": pct(self.ttft, 99),
            "short_ttft_p90_s": pct(self.short_ttft, 90),
            "tpot_p50_s": pct(self.tpot, 50), "tpot_p99_s": pct(self.tpot, 99),
            "slo_violations": self.slo_violations, "prefix_hit_rate": self.prefix_hit_rate,
            "pool_moves": self.pool_moves, "backpressure_waits": self.backpressure_waits,
            "throughput_tok_s": self.output_tokens / self.makespan_s if self.makespan_s else 0.0,
            "makespan_s": self.makespan_s,
        }


class Simulator:
    def __init__(self, config: SimConfig, cost: StepCost) -> None:
        self.cfg = config
        self.cost = cost
        n = config.instances
        disagg = config.mode == "disaggregated"
        if config.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"unknown mode {config.mode!r}")
        if disagg and not 0 < config.decode_instances < n:
            raise ValueError("disaggregated mode needs 0 < decode_instances < instances")
        self.prefill_ids = list(range(n - config.decode_instances if disagg else n))
        self.decode_ids = list(range(len(self.prefill_ids), n)) if disagg else []
        self.inst = [_Instance(cache=ApproxPrefixTree(config.block_size, config.cache_blocks)) for _ in range(n)]
        self.router = Router(config.router, n)
        self.pools: PoolController | None = None
        if config.laps_pools is not None:
            s, l = config.laps_pools
            if s + l != len(self.prefill_ids):
                raise ValueError(f"LAPS pools {s}:{l} must cover the {len(self.prefill_ids)} prefill instances")
            self.pools = PoolController(config.pool_config, self.prefill_ids[:s], self.prefill_ids[s:])
        self.placer = DecodePlacer(config.max_requests_in_scheduler, [0] * n) if disagg else None
        self.handoff: deque[_Req] = deque()  # prefilled, waiting for a decode slot (backpressure)
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.reused = self.computed = 0

    # --- events -----------------------------------------------------------------------

    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        reqs = [_Req(t, i, todo=len(t.prompt)) for i, t in enumerate(trace)]
        for r in reqs:
            self._push(r.trace.arrival, "arrive", r)
        if self.pools is not None:
            self._push(0.0, "rebalance", None)
        now = 0.0
        remaining = len(reqs)
        while self._events and remaining:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(now, payload)  # type: ignore[arg-type]
            elif kind == "step_done":
                remaining -= self._step_done(now, *payload)  # type: ignore[misc]
            elif kind == "handoff_done":
                self._land(now, payload)  # type: ignore[arg-type]
            elif kind == "rebalance":
                self.pools.rebalance(now, [self._work(i) for i in range(len(self.inst))])  # type: ignore[union-attr]
                self._push(now + self.cfg.rebalance_every_s, "rebalance", None)
        return self._result(reqs, now)

    def _loads(self) -> list[float]:
        return [len(i.waiting) + len(i.running) for i in self.inst]

    def _work(self, i: int) -> float:
        return sum(self.cost.prefill_seconds(r.todo) for r in self.inst[i].waiting)

    def _arrive(self, now: float, r: _Req) -> None:
        cands = self.prefill_ids
        if self.pools is not None:
            cands = self.pools.members(self.pools.pool_of(len(r.trace.prompt)))
        i = self.router.route(r.trace.prompt, self._loads(), cands).replica
        inst = self.inst[i]
        matched = min(inst.cache.match(r.trace.prompt), len(r.trace.prompt) - 1)  # type: ignore[union-attr]
        inst.cache.insert(r.trace.prompt)  # type: ignore[union-attr]
        self.reused += matched
        self.computed += len(r.trace.prompt) - matched
        r.done, r.todo = matched, len(r.trace.prompt) - matched
        inst.waiting.append(r)
        self._kick(now, i)

    def _kick(self, now: float, i: int) -> None:
        inst = self.inst[i]
        if inst.busy or not (inst.waiting or inst.running):
            return
        rows: list[tuple[int, int]] = []
        decoded = [r for r in inst.running]
        rows.extend((1, r.done) for r in decoded)
        budget = self.cfg.max_num_batched_tokens - len(rows)
        prefills: list[tuple[_Req, int]] = []
        order = list(inst.waiting)
        if self.cfg.prefill_policy == "srpt":
            order.sort(key=lambda r: r.todo)
        slots = self.cfg.max_num_seqs - len(inst.running)
        for r in order:
            if budget <= 0 or slots <= 0:
                break
            n = min(r.todo, budget)
            prefills.append((r, n))
            rows.append((n, r.done))
            budget -= n
            slots -= 1
        if not rows:
            return
        inst.busy = True
        self._push(now + self.cost.seconds(rows), "step_done", (i, decoded, prefills))

    def _step_done(self, now: float, i: int, decoded: list[_Req], prefills: list[tuple[_Req, int]]) -> int:
        inst = self.inst[i]
        inst.busy = False
        finished = 0
        for r in decoded:
            r.done += 1
            r.emitted += 1
            r.last_token = now
            if r.emitted >= r.trace.output_tokens:
                r.finish = now
                inst.running.remove(r)
                finished += 1
                if self.placer is not None:
                    self.placer.release(i)
        for r, n in prefills:
            r.done += n
            r.todo -= n
            if r.todo:
                continue
            inst.waiting.remove(r)
            r.first_token = r.last_token = now
            r.emitted = 1
            if r.emitted >= r.trace.output_tokens:
                r.finish = now
                finished += 1
            elif self.placer is None:
                inst.running.append(r)
            else:
                self.handoff.append(r)
        self._drain_handoff(now)
        self._kick(now, i)
        return finished

    def _drain_handoff(self, now: float) -> None:
        while self.handoff:
            d = self.placer.place(self.decode_ids)  # type: ignore[union-attr]
            if d is None:
                return  # backpressure: the prefilled requests wait for a decode slot
            r = self.handoff.popleft()
            r.decode_at = d
            self._push(now + self.cfg.handoff_s_per_token * r.done, "handoff_done", r)

    def _land(self, now: float, r: _Req) -> None:
        self.inst[r.decode_at].running.append(r)  # type: ignore[index]
        self._kick(now, r.decode_at)  # type: ignore[arg-type]

    def _result(self, reqs: list[_Req], end: float) -> SimResult:
        done = [r for r in reqs if r.finish is not None]
        ttft = [r.first_token - r.trace.arrival for r in done]  # type: ignore[operator]
        tpot = [(r.finish - r.first_token) / (r.emitted - 1) for r in done if r.emitted > 1]  # type: ignore[operator]
        boundary = self.cfg.pool_config.boundary
        short = [r.first_token - r.trace.arrival for r in done if len(r.trace.prompt) < boundary]  # type: ignore[operator]
        violations = sum(1 for r, t in zip(done, ttft) if t > r.trace.ttft_slo_s) + (len(reqs) - len(done))
        total = self.reused + self.computed
        return SimResult(
            ttft=ttft, tpot=tpot, slo_violations=violations, short_ttft=short, finished=len(done),
            prefix_hit_rate=self.reused / total if total else 0.0,
            pool_moves=len(self.pools.moves) if self.pools else 0,
            backpressure_waits=self.placer.waits if self.placer else 0, makespan_s=end,
            output_tokens=sum(r.emitted for r in done),
        )


def synthetic_trace(
    n: int, rate: float, *, seed: int = 0, short_len: tuple[int, int] = (32, 192), long_len: tuple[int, int] = (1024, 3072),
    long_fraction: float = 0.2, output_len: tuple[int, int] = (32, 256), shared_prefixes: int = 0,
    prefix_len: int = 256, short_slo_s: float = 0.5, long_slo_s: float = 5.0, vocab: int = 32000,
) -> list[TraceRequest]:
    """Poisson arrivals; a mix of short and long prompts; with `shared_prefixes`, every
    prompt starts with one of that many shared system prompts (token lists)."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(vocab) for _ in range(prefix_len)) for _ in range(shared_prefixes)]
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < long_fraction
        length = rng.randint(*(long_len if long else short_len))
        head = prefixes[rng.randrange(len(prefixes))] if prefixes else ()
        body = tuple(rng.randrange(vocab) for _ in range(max(1, length - len(head))))
        out.append(TraceRequest(t, head + body, rng.randint(*output_len), long_slo_s if long else short_slo_s))
    return out
