"""The Ray-backed EngineClient: the FastAPI app talks to N engine replicas through it.

A request is validated here, once (tokens checked, budget clamped, class picked), then
routed to a replica, which runs the prepared Request. Faults use Ray's own machinery:
replicas are actors with `max_restarts`; a call to a dead one raises RayActorError,
and a monitor thread pings a down replica until Ray has restarted it. Retries: a
request that has produced nothing yet moves to another replica (at most
`FaultConfig.max_retries` times); one that has produced output ends with ReplicaLostError,
which a consumer that has sent nothing to its client (a non-streamed answer) answers by
running the request again (counted here as a rerun), and a started stream turns into an
error event.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from prelude.cluster.pools import PoolController
from prelude.cluster.router import Router
from prelude.engine.client import EngineUnavailableError, ReplicaLostError
from prelude.engine.metrics import RequestMetrics
from prelude.engine.remote import ReplicaInfo, ValidatingFront
from prelude.engine.request import LoraRequest, PoolingParams, Request, RequestOutput, SamplingParams

logger = logging.getLogger("prelude.cluster")

# Errors that mean "this replica is gone" (dead, or restarting), not "this request is bad".
_REPLICA_DOWN: tuple[type[BaseException], ...] = (RayActorError, ActorUnavailableError)


@dataclass(frozen=True)
class FaultConfig:
    poll_s: float = 0.5  # how often the monitor pings down replicas
    call_timeout_s: float = 10.0  # metrics / integrity calls to one replica
    wait_for_replica_s: float = 30.0  # a request with no live replica waits this long, then 503
    max_retries: int = 3  # moves of one request to another replica after its replica died, then 503


class RayEngineClient(ValidatingFront):
    def __init__(
        self, replicas: Sequence[Any], router: Router, info: ReplicaInfo | None = None,
        faults: FaultConfig = FaultConfig(), pools: PoolController | None = None, seed: int = 0,
    ) -> None:
        if not replicas:
            raise ValueError("need at least one replica")
        self._replicas = list(replicas)
        self._routable = list(range(len(self._replicas)))  # replicas new requests may go to
        self.faults = faults
        super().__init__(info or ray.get(self._replicas[0].info.remote()), seed)
        self._router = router
        self._router_lock = threading.Lock()
        self._in_flight = [0] * len(replicas)
        self._front_id, self._calls = uuid.uuid4().hex[:12], itertools.count()  # call tickets (_ticket)
        self._abandons: list[ray.ObjectRef] = []  # abandon messages sent, perhaps not yet processed
        self._abandons_lock = threading.Lock()
        self._pools = pools  # LAPS spatial mode: short and long prompts on separate replica pools
        self._unprefilled = [0] * len(replicas)  # prompt tokens sent that have no first token yet
        self._up = [True] * len(replicas)
        self._counts = {"retried_total": 0, "failed_mid_stream_total": 0, "rerun_total": 0,
                        "replica_failures_total": 0, "replica_recoveries_total": 0}
        # Requests that died with output on a replica, by id: a consumer that runs one
        # again (ReplicaLostError) is counted and logged as a rerun. Bounded, oldest out.
        self._lost: dict[str, int] = {}
        self._stopping = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="prelude-replica-monitor", daemon=True)
        self._monitor.start()

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    # --- routing and running -------------------------------------------------------------

    def _route(self, req: Request) -> int | None:
        cands = [r for r in self._routable if self._up[r]]
        if not cands:
            return None
        with self._router_lock:
            if self._pools is not None:
                self._pools.rebalance(time.monotonic(), self._unprefilled)
                pool = [r for r in self._pools.members(self._pools.pool_of(req.num_prompt_tokens)) if self._up[r]]
                cands = pool or cands  # a pool with no live replica borrows the other's
            adapter = req.lora.name if req.lora is not None else None
            return self._router.route(req.prompt_token_ids, self._in_flight, cands, adapter=adapter).replica

    async def _pick(self, req: Request) -> int:
        """A live replica (a failed one is down until Ray has restarted it); waits,
        bounded, for a restart when none is live."""
        deadline = time.monotonic() + self.faults.wait_for_replica_s
        while (r := self._route(req)) is None:
            if time.monotonic() > deadline:
                raise EngineUnavailableError("no engine replica is available; retry later")
            await asyncio.sleep(self.faults.poll_s / 2)
        return r

    def _replica_failed(
        self, r: int, exc: BaseException, streamed: bool, role: str, req: Request, tries: int,
        retry_count: str = "retried_total",
    ) -> None:
        """Replica `r` died serving `req`: mark it down; a request that has produced output
        cannot move (raises ReplicaLostError), one that has not is tried elsewhere, at
        most `max_retries` times (`tries`: moves so far)."""
        self._mark_down(r, exc)
        if streamed:
            self._counts["failed_mid_stream_total"] += 1
            self._lost[req.request_id] = r
            while len(self._lost) > 10_000:
                del self._lost[next(iter(self._lost))]
            raise ReplicaLostError(
                f"the {role} replica serving this request failed after it had produced output: {exc}") from None
        if tries >= self.faults.max_retries:
            raise EngineUnavailableError(
                f"request {req.request_id}: {tries + 1} {role} replicas failed under it; retry later") from None
        self._counts[retry_count] += 1
        logger.warning("%s replica %d failed before request %s streamed; trying another (move %d of at most %d)",
                       role, r, req.request_id, tries + 1, self.faults.max_retries)

    def _note_rerun(self, request_id: str) -> None:
        """A request that died with output on a replica is run again by its consumer."""
        r = self._lost.pop(request_id, None)
        if r is not None:
            self._counts["rerun_total"] += 1
            logger.warning("request %s runs again from the start (replica %d died before it answered)", request_id, r)

    def _ticket(self) -> str:
        """A name for one replica call, unique across fronts (call_ledger.py)."""
        return f"{self._front_id}-{next(self._calls)}"

    def _abandon(self, r: int, gen: object, ticket: str) -> None:
        """Stop call `ticket` on replica `r`, which has not ended: cancel its coroutine
        (its cleanup aborts the request there) and, as Ray's cancel misses a call that has
        not begun, tell the replica too (a dead replica holds nothing to stop)."""
        ray.cancel(gen)
        if self._up[r]:
            ref = self._replicas[r].abandon.remote(ticket)
            with self._abandons_lock:
                self._abandons.append(ref)
            if len(self._abandons) > 64:
                self.abandons_pending()

    def abandons_pending(self) -> int:
        """Abandon messages (_abandon) their replicas have not processed yet. Once there
        are none, no abandoned call can begin any more (call_ledger.py): a settled
        cluster has none, and no replica call in flight."""
        with self._abandons_lock:
            if self._abandons:
                _, self._abandons = ray.wait(self._abandons, num_returns=len(self._abandons), timeout=0)
            return len(self._abandons)

    def _release(self, r: int, req: Request, gen: object, ticket: str, *, streamed: bool, ended: bool) -> None:
        """A stream on replica `r` is over: drop its load, and abandon the replica's
        call unless the request ended."""
        self._in_flight[r] -= 1
        if not streamed:
            self._unprefilled[r] -= req.num_prompt_tokens
        if not ended:
            self._abandon(r, gen, ticket)

    async def _run(self, req: Request) -> AsyncIterator[RequestOutput]:
        tries = 0
        while True:
            r = await self._pick(req)
            self._in_flight[r] += 1
            self._unprefilled[r] += req.num_prompt_tokens
            streamed = finished = False
            ticket = self._ticket()
            gen = self._replicas[r].generate.options(num_returns="streaming").remote(req, ticket)
            try:
                async for ref in gen:
                    out: RequestOutput = await ref
                    if not streamed:
                        self._unprefilled[r] -= req.num_prompt_tokens
                    streamed = True
                    finished = out.finished
                    yield out
                    if finished:
                        return
                raise EngineUnavailableError(f"replica {r} ended request {req.request_id} without a result")
            except _REPLICA_DOWN as exc:
                self._replica_failed(r, exc, streamed, "engine", req, tries)
                tries += 1
            finally:
                self._release(r, req, gen, ticket, streamed=streamed, ended=finished)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora: LoraRequest | None = None
    ) -> AsyncIterator[RequestOutput]:
        req = self._prepare(request_id, prompt_token_ids, params, None, lora)  # InvalidRequestError before any stream
        self._note_rerun(request_id)
        return self._run(req)

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams,
                     lora: LoraRequest | None = None) -> RequestOutput:
        req = self._prepare(request_id, prompt_token_ids, SamplingParams(max_tokens=0), pooling, lora)
        async for out in self._run(req):
            if out.finished:
                return out
        raise RuntimeError(f"request {request_id} ended without a result")

    async def check_adapter(self, lora: LoraRequest) -> tuple[str, ...]:
        """Read and check a LoRA adapter on a live replica (every replica reads it from the
        same path when a step needs it); the labels of its own head, or ()."""
        live = [r for r in range(len(self._replicas)) if self._up[r]]
        if not live:
            raise EngineUnavailableError("no engine replica is available; retry later")
        labels = await self._replicas[live[0]].check_adapter.remote(lora)
        self._adapter_labels[lora.id] = labels
        return labels

    async def abort(self, request_id: str) -> None:
        for r, replica in enumerate(self._replicas):
            if self._up[r]:
                replica.abort.remote(request_id)

    # --- health, metrics ------------------------------------------------------------------

    def _mark_down(self, r: int, exc: BaseException | None = None) -> None:
        if self._up[r]:
            self._up[r] = False
            self._counts["replica_failures_total"] += 1
            logger.error("replica %d is down (%s); Ray restarts it", r, type(exc).__name__ if exc else "no answer")

    def _watch(self) -> None:
        """Ping every replica: Ray raises RayActorError for a dead one (a slow answer is
        not a death: busy replicas are left alone). Down replicas are pinged until Ray
        has restarted them; a restarted replica lost its cache, so the router forgets
        what it sent there."""
        # One ping in flight per replica, kept until it answers: on a very busy machine an
        # answer may take longer than a poll, and a fresh ping each poll would never see it
        # (a restarted replica stayed down at a load average of 100).
        pending: dict[int, Any] = {}
        while not self._stopping.wait(self.faults.poll_s):
            for r in range(len(self._replicas)):
                if r not in pending:
                    pending[r] = self._replicas[r].ping.remote()
            for r, ref in list(pending.items()):
                try:
                    ray.get(ref, timeout=self.faults.poll_s)
                except GetTimeoutError:
                    continue
                except _REPLICA_DOWN as exc:
                    del pending[r]
                    self._mark_down(r, exc)
                    continue
                del pending[r]
                if self._up[r]:
                    continue
                with self._router_lock:
                    self._router.forget(r)
                self._up[r] = True
                self._counts["replica_recoveries_total"] += 1
                logger.warning("replica %d is back", r)

    def is_healthy(self) -> bool:
        return any(self._up)

    def health(self) -> dict[str, Any]:
        """`ok`, `degraded` (some replica down: still serving) or `down`."""
        live = sum(self._up)
        status = "ok" if live == len(self._up) else ("degraded" if live else "down")
        return {"status": status, "replicas_live": live, "replicas_total": len(self._up)}

    def _gather(self, method: str) -> dict[int, Any]:
        refs = {r: getattr(rep, method).remote() for r, rep in enumerate(self._replicas) if self._up[r]}
        out = {}
        for r, ref in refs.items():
            try:
                out[r] = ray.get(ref, timeout=self.faults.call_timeout_s)
            except _REPLICA_DOWN as exc:
                self._mark_down(r, exc)
            except GetTimeoutError:
                pass
        return out

    def replica_metrics(self) -> dict[int, dict[str, float]]:
        return self._gather("metrics")

    def metrics(self) -> dict[str, float]:
        """Engine counters summed over live replicas (hit rate recomputed from the sums)."""
        total: dict[str, float] = {}
        for m in self.replica_metrics().values():
            for k, v in m.items():
                total[k] = total.get(k, 0.0) + v
        total.pop("in_flight", None)
        reused, computed = total.get("prefix_reused_tokens_total", 0.0), total.get("prefix_computed_tokens_total", 0.0)
        total["prefix_cache_hit_rate"] = reused / (reused + computed) if reused + computed else 0.0
        total.update({f"cluster_{k}": float(v) for k, v in self._counts.items()})
        return total

    def cluster_metrics(self) -> list[tuple[str, str, str, dict[str, str], float]]:
        """(name, counter|gauge, help, labels, value) samples for /metrics: router decisions,
        each replica's liveness, load and prefix hit rate (real and as the router guesses
        it), LAPS pools, fault counters."""
        out: list[tuple[str, str, str, dict[str, str], float]] = []
        for r, m in self.replica_metrics().items():
            out.append(("replica_prefix_cache_hit_rate", "gauge", "Prefix-cache hit rate of each replica's engine.",
                        {"replica": str(r)}, m["prefix_cache_hit_rate"]))
        for r in range(len(self._replicas)):
            out.append(("replica_up", "gauge", "1 while the replica answers.", {"replica": str(r)}, float(self._up[r])))
            out.append(("replica_requests_in_flight", "gauge", "Requests the front has on each replica.",
                        {"replica": str(r)}, float(self._in_flight[r])))
        with self._router_lock:
            stats = self._router.stats
            for (r, reason), n in sorted(stats.decisions.items()):
                out.append(("router_decisions", "counter", "Routing decisions by replica and reason.",
                            {"replica": str(r), "reason": reason}, float(n)))
            for r in range(len(self._replicas)):
                out.append(("router_estimated_prefix_hit_rate", "gauge",
                            "Share of routed prompt tokens the router's tree of that replica already held.",
                            {"replica": str(r)}, self._router.estimated_hit_rate(r)))
            if self._pools is not None:
                for name, members in self._pools.pools.items():
                    out.append(("laps_pool_replicas", "gauge", "Replicas in each LAPS pool.", {"pool": name},
                                float(len(members))))
                out.append(("laps_pool_moves", "counter", "Replicas moved between LAPS pools.", {},
                            float(len(self._pools.moves))))
        for k, v in self._counts.items():
            out.append((f"cluster_{k.removesuffix('_total')}", "counter", k.replace("_", " "), {}, float(v)))
        return out

    def request_metrics(self) -> list[RequestMetrics]:
        return [m for ms in self._gather("request_metrics").values() for m in ms]

    def check_integrity(self) -> None:
        """LLMEngine.check_integrity on every live replica (each waits until idle)."""
        refs = [rep.check_integrity.remote() for r, rep in enumerate(self._replicas) if self._up[r]]
        ray.get(refs, timeout=self.faults.call_timeout_s * 2)

    def pool_moves(self) -> list[Any]:
        """LAPS pool moves so far, each with its time, replica, direction and reason."""
        return list(self._pools.moves) if self._pools is not None else []

    def close(self) -> None:
        """Stop watching the replicas (they keep running: another client may own them)."""
        self._stopping.set()
        self._monitor.join(timeout=5)

    def shutdown(self) -> None:
        self.close()
        for replica in self._replicas:
            ray.kill(replica, no_restart=True)
