"""One HTTP process: the FastAPI app over a ProcEngineClient, served on the listening
socket that the supervisor bound once and every HTTP process shares (the kernel hands
each new connection to one of them)."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

import uvicorn

from prelude.entrypoints.multiproc.proc_client import ProcEngineClient
from prelude.entrypoints.multiproc.wire import read_frame_blocking
from prelude.entrypoints.openai.drain import DrainingServer
from prelude.entrypoints.openai.limits import ServerLimits

logger = logging.getLogger("prelude.front")

# After the engine died, the requests failed here get this long to send their error bodies.
_DEATH_FLUSH_S = 5.0
_CONNECT_POLL_S = 0.05  # how often a starting HTTP process looks for the engine's socket


@dataclass(frozen=True)
class RayReplicas:
    """Engines on Ray instead of an engine process: the named replica actors to join."""

    address: str  # the Ray cluster's GCS address
    namespace: str
    names: tuple[str, ...]
    cluster: Any  # prelude.cluster.launch.ClusterConfig (not imported here: Ray is optional)


@dataclass(frozen=True)
class FrontSettings:
    """What every HTTP process is started with (picklable: a spawn argument)."""

    model: str | None
    engine_path: str | None  # the engine process's Unix socket (None: engines on Ray)
    engine_pid: int | None
    ray: RayReplicas | None
    count: int
    seed: int
    api_key: str | None
    limits: ServerLimits
    metrics_require_key: bool
    log_level: str
    log_format: str


class FrontServer(DrainingServer):
    """DrainingServer whose engine connection joins its event loop at startup, and which
    stops (exit code 1) once the engine process is gone and the failed requests are answered."""

    def __init__(self, config: uvicorn.Config, client: Any, limits: ServerLimits, gate: object) -> None:
        super().__init__(config, gate, limits.shutdown_timeout_s, client)  # type: ignore[arg-type]
        self.client = client
        self.engine_died = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if isinstance(self.client, ProcEngineClient):
            await self.client.start()
            self.client.on_dead = self._on_engine_death
        await super().startup(sockets)

    def _on_engine_death(self) -> None:
        self.engine_died = True
        self.gate.draining = True  # new requests: 503 at the door

        async def stop() -> None:
            await self.gate.wait_idle(_DEATH_FLUSH_S)
            self.should_exit = True

        asyncio.get_running_loop().create_task(stop())


def _connect(path: str, engine_pid: int | None = None) -> tuple[socket.socket, Any]:
    """Connect to the engine process and read its ReplicaInfo (blocking: before the loop
    runs). The engine may still be loading: wait for its socket, exit 1 if it died."""
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if engine_pid is not None and not _alive(engine_pid):
                raise SystemExit(1) from None
            time.sleep(_CONNECT_POLL_S)
    info = pickle.loads(read_frame_blocking(conn))
    return conn, info


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A dead child of the supervisor is a zombie until reaped: still "there" for kill(0).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _tokenizer_for(info: Any, model: str | None) -> Any:
    """`info` with a tokenizer: engines ship none (it is large, or does not pickle), so each
    HTTP process loads its own from the same files."""
    from prelude.model.loading.files import resolve_model_dir
    from prelude.tokenizer.loading import load_tokenizer

    if info.tokenizer is not None:
        return info
    return replace(info, tokenizer=load_tokenizer(resolve_model_dir(model)[0]))


def _ray_client(spec: RayReplicas, settings: FrontSettings, index: int) -> Any:
    """This HTTP process's own client over the named replicas (its own router and monitor)."""
    import ray

    from prelude.cluster.launch import client_over

    ray.init(address=spec.address, namespace=spec.namespace, log_to_driver=False)
    replicas = [ray.get_actor(name) for name in spec.names]
    info = _tokenizer_for(ray.get(replicas[0].info.remote()), settings.model)
    client = client_over(replicas, spec.cluster, info, seed=settings.seed * 1_000_003 + index)
    replicas_health = client.health
    # /health says which HTTP process answered, as ProcEngineClient's does.
    client.health = lambda: {**replicas_health(), "api_server": index, "api_servers": settings.count}
    return client


def front_main(index: int, listener: socket.socket, settings: FrontSettings) -> None:
    """One HTTP process's entry (multiprocessing spawn target); exits 1 if the engine died."""
    from prelude.heap import freeze_startup_heap
    from prelude.entrypoints.multiproc.child import child_setup
    from prelude.entrypoints.openai.api_server import build_app

    child_setup(settings.log_level, settings.log_format)
    client: Any
    if settings.ray is not None:
        client = _ray_client(settings.ray, settings, index)
    else:
        assert settings.engine_path is not None
        conn, info = _connect(settings.engine_path, settings.engine_pid)
        client = ProcEngineClient(_tokenizer_for(info, settings.model), conn, index, settings.count, settings.seed,
                                  settings.engine_pid)
    app = build_app(client, api_key=settings.api_key, limits=settings.limits,
                    metrics_require_key=settings.metrics_require_key)
    config = uvicorn.Config(app, timeout_keep_alive=30, access_log=False, log_config=None, ws="none")  # no WebSocket route
    server = FrontServer(config, client, settings.limits, app.state.gate)
    logger.info("api server %d of %d ready", index, settings.count)
    freeze_startup_heap()
    try:
        server.run(sockets=[listener])
    finally:
        # A Ray client only stops watching: the replicas belong to the supervisor.
        client.close() if settings.ray is not None else client.shutdown()
    raise SystemExit(1 if server.engine_died else 0)
