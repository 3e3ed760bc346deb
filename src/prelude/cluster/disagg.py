"""Prefill/decode disaggregation on Ray (Prophet): the front of P prefill and D decode replicas.

A request is validated once at the front and routed (the router, over the prefill
replicas) to a prefill replica. That replica computes the prompt in its prefill policy's
order (SRPT by default), samples the first token (so TTFT is the prefill side's) and
yields the request's KV blocks, which Ray stores once in its object store. The front
handles only the object's reference: it asks the DecodePlacer (cluster/pools.py, the
rule the simulator runs) for the decode replica holding the fewest requests, never past
`max_requests_in_scheduler`; when every decode replica is full the hand-off waits here,
first come first served (backpressure), so a burst never runs the decode side out of
KV. The decode replica fetches the blocks, copies them into its own pool and streams
the rest (decode policy: MLFQ by default).

Faults: before its first token, a request whose prefill replica died moves to another
one (as in RayEngineClient); a decode replica that dies before it streamed anything is
replaced by another with the same hand-off (the object store still holds it, owned by
this front); a request that has produced output ends with ReplicaLostError (a
non-streamed answer runs again from the start, a started stream ends with an error event).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Sequence

import ray
from ray.exceptions import ObjectLostError, RayTaskError

from prelude.cluster.client import _REPLICA_DOWN, FaultConfig, RayEngineClient
from prelude.cluster.pools import DecodePlacer, PoolController
from prelude.cluster.replica import ReplicaInfo
from prelude.cluster.router import Router
from prelude.engine.client import EngineUnavailableError, ReplicaLostError
from prelude.engine.request import Request, RequestOutput


logger = logging.getLogger("prelude.cluster")


def _handoff_lost(exc: BaseException) -> bool:
    """Whether a decode call failed because its hand-off object could not be fetched (it
    died with the prefill replica that stored it), not because the decode replica died.
    Ray reports a failed reconstruction as a task error wrapping the cause; such a
    RayTaskError is also an instance of its cause (an ActorUnavailableError passes the
    "replica down" check), so the wrapper is what tells the two apart."""
    return isinstance(exc, ObjectLostError) or (
        isinstance(exc, RayTaskError) and isinstance(exc.cause, _REPLICA_DOWN + (ObjectLostError,)))


class HandoffGate:
    """The DecodePlacer behind a first-come-first-served line of waiting hand-offs (used
    from one asyncio loop at a time). A release wakes the head of the line; a periodic
    re-check covers decode replicas that come back after a failure."""

    def __init__(self, placer: DecodePlacer, recheck_s: float) -> None:
        self.placer = placer
        self.recheck_s = recheck_s
        self._line: deque[asyncio.Future[None]] = deque()
        self.waited = 0  # hand-offs that found every decode replica full (or none live)
        self.max_held: list[int] = [0] * len(placer.held)  # high-water mark of each replica's holdings

    @property
    def waiting(self) -> int:
        return len(self._line)

    def _place(self, candidates: Sequence[int]) -> int | None:
        d = self.placer.place(candidates)
        if d is not None:
            self.max_held[d] = max(self.max_held[d], self.placer.held[d])
        return d

    async def acquire(self, candidates: Callable[[], list[int]], no_replica_timeout_s: float) -> int:
        if not self._line and (d := self._place(candidates())) is not None:
            return d
        self.waited += 1
        loop = asyncio.get_running_loop()
        me: asyncio.Future[None] = loop.create_future()
        self._line.append(me)
        none_since: float | None = None
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(me), self.recheck_s)
                except asyncio.TimeoutError:
                    pass
                if me.done():  # woken: take a fresh future, keep the place in line
                    fresh: asyncio.Future[None] = loop.create_future()
                    self._line[self._line.index(me)] = fresh
                    me = fresh
                if self._line[0] is not me:
                    continue
                cands = candidates()
                if (d := self._place(cands)) is not None:
                    return d
                if not cands:  # no decode replica is live: wait for a restart, bounded
                    none_since = none_since or time.monotonic()
                    if time.monotonic() - none_since > no_replica_timeout_s:
                        raise EngineUnavailableError("no decode replica is available; retry later")
                else:
                    none_since = None
        finally:
            self._line.remove(me)
            self._wake_head()  # capacity may be left for the next in line

    def release(self, d: int) -> None:
        self.placer.release(d)
        self._wake_head()

    def _wake_head(self) -> None:
        if self._line and not self._line[0].done():
            self._line[0].set_result(None)


class DisaggregatedClient(RayEngineClient):
    """Replicas [0, num_prefill) prefill, the rest decode; everything else (validation,
    routing, health, metrics, integrity) as RayEngineClient."""

    def __init__(
        self, replicas: Sequence[Any], router: Router, num_prefill: int, max_requests_in_scheduler: int,
        info: ReplicaInfo | None = None, faults: FaultConfig = FaultConfig(), pools: PoolController | None = None,
        seed: int = 0,
    ) -> None:
        if not 0 < num_prefill < len(replicas):
            raise ValueError("disaggregation needs at least one prefill and one decode replica")
        if max_requests_in_scheduler < 1:
            raise ValueError("--max-requests-in-scheduler must be at least 1")
        super().__init__(replicas, router, info, faults, pools, seed)
        self.num_prefill = num_prefill
        self.decode_ids = list(range(num_prefill, len(replicas)))
        self._routable = list(range(num_prefill))
        self.gate = HandoffGate(DecodePlacer(max_requests_in_scheduler, [0] * len(replicas)), faults.poll_s)
        self._counts.update({"handoffs_total": 0, "decode_retried_total": 0, "handoffs_lost_total": 0})

    def _live_decode(self) -> list[int]:
        return [d for d in self.decode_ids if self._up[d]]

    async def _run(self, req: Request) -> AsyncIterator[RequestOutput]:
        handoff: list[ray.ObjectRef] = []  # a list: _decode takes the only reference
        # aclosing: a client that leaves closes the inner stream now (its replica aborts).
        async with aclosing(self._prefill(req)) as items:
            async for item in items:
                if isinstance(item, RequestOutput):
                    yield item
                else:
                    handoff.append(item)
            item = None  # not kept alive here
        if not handoff:
            return  # the first token finished it (or it was OneShot): nothing to decode
        async with aclosing(self._decode(req, handoff.pop())) as outs:
            async for out in outs:
                yield out

    async def _prefill(self, req: Request) -> AsyncIterator[RequestOutput | ray.ObjectRef]:
        """The first-token increment, then the reference of the hand-off (its KV stays in
        the object store: the front never reads it)."""
        tries = 0
        while True:
            r = await self._pick(req)
            self._in_flight[r] += 1
            self._unprefilled[r] += req.num_prompt_tokens
            streamed = done = False
            ticket = self._ticket()
            gen = self._replicas[r].prefill.options(num_returns="streaming").remote(req, ticket)
            try:
                try:
                    out: RequestOutput = await (await gen.__anext__())
                except StopAsyncIteration:
                    raise EngineUnavailableError(f"replica {r} ended request {req.request_id} without a result") \
                        from None
                self._unprefilled[r] -= req.num_prompt_tokens
                streamed = True
                yield out
                if out.finished:
                    done = True
                    return
                try:
                    ref = await gen.__anext__()  # an ObjectRef, not awaited: the decode replica fetches it
                except StopAsyncIteration:
                    raise EngineUnavailableError(f"replica {r} did not hand off request {req.request_id}") from None
                done = True
                self._counts["handoffs_total"] += 1
                yield ref
                return
            except _REPLICA_DOWN as exc:
                self._replica_failed(r, exc, streamed, "prefill", req, tries)
                tries += 1
            finally:
                self._release(r, req, gen, ticket, streamed=streamed, ended=done)

    async def _decode(self, req: Request, handoff: ray.ObjectRef | None) -> AsyncIterator[RequestOutput]:
        """Place the hand-off (waiting while every decode replica is full) and stream the
        rest; a decode replica that dies before streaming is replaced by another. Once a
        replica streams, the front drops its reference (Ray frees the object when the
        decode task lets go of it too)."""
        tries = 0
        while handoff is not None:
            d = await self.gate.acquire(self._live_decode, self.faults.wait_for_replica_s)
            self._in_flight[d] += 1
            streamed = finished = False
            ticket = self._ticket()
            gen = self._replicas[d].decode.options(num_returns="streaming").remote(handoff, ticket)
            try:
                async for ref in gen:
                    out: RequestOutput = await ref
                    streamed, handoff = True, None
                    finished = out.finished
                    yield out
                    if finished:
                        return
                raise EngineUnavailableError(f"replica {d} ended request {req.request_id} without a result")
            except _REPLICA_DOWN + (ObjectLostError,) as exc:
                if _handoff_lost(exc) and not streamed:
                    self._handoff_lost(d, req, exc)
                self._replica_failed(d, exc, streamed, "decode", req, tries, retry_count="decode_retried_total")
                tries += 1
            finally:
                self._in_flight[d] -= 1
                self.gate.release(d)
                if not finished:
                    self._abandon(d, gen, ticket)

    def _handoff_lost(self, d: int, req: Request, exc: BaseException) -> None:
        """The hand-off could not be fetched: its object died with the prefill replica that
        made it (Ray reports the failed reconstruction as a task error on decode replica `d`,
        which is alive). The decode replica is not charged; the request already has its first
        token, so it ends with ReplicaLostError and a non-streamed answer runs again from the
        start on a live prefill replica."""
        self._counts["handoffs_lost_total"] += 1
        self._lost[req.request_id] = d
        logger.warning("request %s: its KV hand-off was lost with its prefill replica (%s); decode replica %d "
                       "stays up, the request runs again", req.request_id, type(exc).__name__, d)
        raise ReplicaLostError(f"the prefill replica that held this request's KV failed: {exc}") from None

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "cluster_handoff_waits_total": float(self.gate.waited),
                "cluster_handoffs_waiting": float(self.gate.waiting)}

    def cluster_metrics(self) -> list[tuple[str, str, str, dict[str, str], float]]:
        out = super().cluster_metrics()
        for d in self.decode_ids:
            out.append(("decode_requests_held", "gauge", "Requests each decode replica holds (capped by "
                        "--max-requests-in-scheduler).", {"replica": str(d)}, float(self.gate.placer.held[d])))
        out.append(("handoff_waits", "counter", "Hand-offs that found every decode replica full.", {},
                    float(self.gate.waited)))
        out.append(("handoffs_waiting", "gauge", "Prefilled requests waiting for a decode replica (backpressure).",
                    {}, float(self.gate.waiting)))
        return out
