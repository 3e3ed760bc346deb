"""Prelude inside a Ray Serve application.

Two deployments: `EngineServer` (one engine per Serve replica; Serve scales it with its
own autoscaling settings, restarts it when `check_health` fails, and routes to it with
its own request router) and `PreludeFront` (the same FastAPI app as `prelude serve`,
over a handle to the engines). A request is validated once, in the front.

    from ray import serve
    from prelude.entrypoints.ray_serve import build_serve_app
    serve.run(build_serve_app(engine_factory(config), tokenizer_factory=tokenizer_factory(config),
                              autoscaling_config={"min_replicas": 1, "max_replicas": 4}))
    # engine_factory / tokenizer_factory: prelude.cluster.launch
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.serve.handle import DeploymentHandle

from prelude.cluster.client import ValidatingFront
from prelude.cluster.replica import EngineFactory, EngineReplica, ReplicaInfo
from prelude.engine.metrics import RequestMetrics
from prelude.engine.request import PoolingParams, Request, RequestOutput, SamplingParams
from prelude.entrypoints.openai.api_server import build_app
from prelude.tokenizer.base import Tokenizer


class EngineServer:
    """One engine replica as a Serve deployment."""

    def __init__(self, factory: EngineFactory, threads: int | None = None, seed: int = 0) -> None:
        self._replica = EngineReplica(factory, index=os.getpid(), threads=threads, seed=seed)
        self._tickets = itertools.count()  # each call's ticket (Serve cancels by its own handle, never by these)

    def info(self) -> ReplicaInfo:
        return self._replica.info()

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        async for out in self._replica.generate(req, f"serve-{next(self._tickets)}"):
            yield out

    def metrics(self) -> dict[str, float]:
        return self._replica.metrics()

    def check_health(self) -> None:
        """Serve's health check: a dead engine loop makes Serve replace this replica."""
        if not self._replica.front.is_healthy():
            raise RuntimeError("the engine loop is not running")


class ServeEngineClient(ValidatingFront):
    """EngineClient over a Serve handle. Serve picks the replica; cancelling a streamed
    response cancels the replica's coroutine, which aborts the request there."""

    def __init__(self, handle: DeploymentHandle, info: ReplicaInfo) -> None:
        super().__init__(info)
        self._handle = handle

    async def _run(self, req: Request) -> AsyncIterator[RequestOutput]:
        response = self._handle.options(stream=True).generate.remote(req)
        finished = False
        try:
            async for out in response:
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                response.cancel()

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return self._run(self._prepare(request_id, prompt_token_ids, params, None))

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams) -> RequestOutput:
        async for out in self._run(self._prepare(request_id, prompt_token_ids, SamplingParams(max_tokens=0), pooling)):
            if out.finished:
                return out
        raise RuntimeError(f"request {request_id} ended without a result")

    async def abort(self, request_id: str) -> None:
        """Nothing to do: closing the stream cancels the replica's work."""

    def is_healthy(self) -> bool:
        return True  # Serve health-checks and replaces the engine replicas itself

    def metrics(self) -> dict[str, float]:
        return {}  # per-replica metrics are Serve's (its Prometheus endpoint)

    def request_metrics(self) -> list[RequestMetrics]:
        return []


@serve.ingress()
class PreludeFront:
    def __init__(
        self, engine: DeploymentHandle, api_key: str | None = None,
        tokenizer_factory: Callable[[], Tokenizer] | None = None,
    ) -> None:
        self._engine = engine
        self._api_key = api_key
        self._tokenizer_factory = tokenizer_factory

    async def __serve_build_asgi_app__(self) -> Any:
        info = await self._engine.info.remote()
        if info.tokenizer is None:  # it does not pickle (fasttoken): build the front's own
            if self._tokenizer_factory is None:
                raise ValueError("the engine's tokenizer does not pickle: pass tokenizer_factory")
            info = replace(info, tokenizer=self._tokenizer_factory())
        return build_app(ServeEngineClient(self._engine, info), api_key=self._api_key)


def build_serve_app(
    factory: EngineFactory, *, num_replicas: int | None = None, autoscaling_config: dict[str, Any] | None = None,
    replica_threads: int | None = None, max_ongoing_requests: int = 64, api_key: str | None = None,
    tokenizer_factory: Callable[[], Tokenizer] | None = None,
) -> Any:
    """The Serve application: pass `num_replicas` or Serve's `autoscaling_config`."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": replica_threads or 1},
        "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": 5,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas or 1
    engine = serve.deployment(EngineServer, name="PreludeEngine").options(**options)
    front = serve.deployment(PreludeFront, name="PreludeFront", ray_actor_options={"num_cpus": 0})
    return front.bind(engine.bind(factory, replica_threads), api_key, tokenizer_factory)
