"""Start Ray (or join a cluster) and the engine replica actors; build the front's client."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import ray

from prelude.cluster.client import FaultConfig, RayEngineClient
from prelude.cluster.disagg import DisaggregatedClient
from prelude.cluster.pools import PoolConfig, PoolController
from prelude.cluster.replica import EngineFactory, EngineReplica, ReplicaInfo
from prelude.cluster.router import Router, RouterConfig
from prelude.config import EngineConfig
from prelude.tokenizer.base import Tokenizer

logger = logging.getLogger("prelude.cluster")


@dataclass(frozen=True)
class ClusterConfig:
    num_replicas: int = 2
    replica_threads: int | None = None  # torch threads per replica (None: Ray's OMP_NUM_THREADS)
    ray_address: str | None = None  # None: start a local Ray instance
    router: RouterConfig = field(default_factory=RouterConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    max_restarts: int = -1  # Ray restarts a dead replica this often (-1: always)
    laps_pools: tuple[int, int] | None = None  # (short, long) replicas; None: every replica takes every prompt
    pool: PoolConfig = field(default_factory=lambda: PoolConfig(min_pressure=256))  # pressure in prompt tokens
    disaggregate: tuple[int, int] | None = None  # (prefill, decode) replicas; None: every replica does both
    max_requests_in_scheduler: int = 64  # disaggregated: requests one decode replica holds at most

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        if self.replica_threads is not None and self.replica_threads < 1:
            raise ValueError("--replica-threads must be at least 1")
        if self.disaggregate is not None:
            if min(self.disaggregate) < 1 or sum(self.disaggregate) != self.num_replicas:
                raise ValueError("--disaggregate P:D needs P, D >= 1 and P + D = --data-parallel-size")
            if self.max_requests_in_scheduler < 1:
                raise ValueError("--max-requests-in-scheduler must be at least 1")
        if self.laps_pools is not None and (min(self.laps_pools) < 1 or sum(self.laps_pools) != self.num_prefill):
            raise ValueError("--laps-pools S:L needs S, L >= 1 and S + L = the replicas that prefill "
                             "(--data-parallel-size, or P of --disaggregate P:D)")

    @property
    def num_prefill(self) -> int:
        """Replicas that take new prompts: all of them, or the P of --disaggregate P:D."""
        return self.disaggregate[0] if self.disaggregate is not None else self.num_replicas

    @property
    def cpus_per_replica(self) -> int:
        return self.replica_threads or 1


def ensure_ray(address: str | None, num_cpus: int | None = None, namespace: str | None = None) -> None:
    """Join `address`, or start a local instance sized so that every replica can be placed
    (logical CPUs: on a small machine the replicas share the cores, which is the point
    of --replica-threads). A `namespace` lets other drivers (the HTTP processes of
    --api-server-count) find the replicas by name."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True, namespace=namespace)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, num_cpus or 1), include_dashboard=False, log_to_driver=True,
                 namespace=namespace)


def start_replicas(factory: EngineFactory, cluster: ClusterConfig, seed: int = 0,
                   decode_factory: EngineFactory | None = None, names: list[str] | None = None) -> list[Any]:
    """Replica i builds its engine with `factory`, except the decode replicas of a
    disaggregated cluster (the last D), which use `decode_factory` when given. With
    `names`, replica i is the named actor names[i] (ray.get_actor finds it)."""
    actor = ray.remote(EngineReplica)
    return [
        actor.options(
            num_cpus=cluster.cpus_per_replica, max_restarts=cluster.max_restarts, max_task_retries=0,
            max_concurrency=1000, **({"name": names[i]} if names else {}),
        ).remote(decode_factory if decode_factory is not None and i >= cluster.num_prefill else factory,
                 i, cluster.replica_threads, seed)
        for i in range(cluster.num_replicas)
    ]


def start_client(
    factory: EngineFactory, cluster: ClusterConfig, seed: int = 0,
    tokenizer_factory: Callable[[], Tokenizer] | None = None, decode_factory: EngineFactory | None = None,
) -> RayEngineClient:
    """Replicas up and answering, and the front's EngineClient over them. The front uses
    the replicas' tokenizer when it pickles, else builds its own with `tokenizer_factory`.
    Disaggregated (`cluster.disaggregate`), the decode replicas' engines come from
    `decode_factory` (e.g. another scheduling policy) when given."""
    ensure_ray(cluster.ray_address, cluster.num_replicas * cluster.cpus_per_replica)
    replicas = start_replicas(factory, cluster, seed, decode_factory)
    infos = ray.get([r.info.remote() for r in replicas])  # waits until every replica built its engine
    if infos[0].tokenizer is None:
        if tokenizer_factory is None:
            raise ValueError("the replicas' tokenizer does not pickle: pass a tokenizer_factory")
        infos[0] = replace(infos[0], tokenizer=tokenizer_factory())
    logger.info("%d replicas of %s up", len(replicas), infos[0].model_name)
    return client_over(replicas, cluster, infos[0], seed)


def client_over(replicas: list[Any], cluster: ClusterConfig, info: ReplicaInfo, seed: int = 0) -> RayEngineClient:
    """The front's EngineClient over running replicas (each HTTP process of
    --api-server-count builds its own over the same named replicas)."""
    pools = None
    if cluster.laps_pools is not None:
        s = cluster.laps_pools[0]
        pools = PoolController(cluster.pool, range(s), range(s, cluster.num_prefill))
    if cluster.disaggregate is not None:
        return DisaggregatedClient(replicas, Router(cluster.router, cluster.num_replicas), cluster.disaggregate[0],
                                   cluster.max_requests_in_scheduler, info, cluster.faults, pools, seed=seed)
    return RayEngineClient(replicas, Router(cluster.router, cluster.num_replicas), info, cluster.faults, pools,
                           seed=seed)


def engine_factory(config: EngineConfig) -> EngineFactory:
    """A picklable factory that builds the engine from its config inside the replica."""
    from prelude.engine.engine import LLMEngine

    return functools.partial(LLMEngine.from_config, config)


def _load_tokenizer(model: str | None) -> Tokenizer:
    from prelude.model.loading.files import resolve_model_dir
    from prelude.tokenizer.loading import load_tokenizer

    return load_tokenizer(resolve_model_dir(model)[0])


def tokenizer_factory(config: EngineConfig) -> Callable[[], Tokenizer]:
    """The front's own tokenizer for `config.model` (the same loader the engine uses)."""
    return functools.partial(_load_tokenizer, config.model)
