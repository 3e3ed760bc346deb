"""`prelude serve --api-server-count N`: start the engine process, then N HTTP processes
on one listening socket; watch them; forward SIGTERM / SIGINT as a drain.

Lifecycles (this process owns all of them):
- SIGTERM or SIGINT here: every HTTP process drains (new requests 503, requests in flight
  finish) and exits; then the engine process stops. Exit 0.
- The engine process dies: every HTTP process fails its waiting requests with a 503
  error body and exits 1; exit 1.
- An HTTP process dies: the others drain, the engine stops; exit 1.
The children run in their own process group (a terminal's Ctrl-C reaches only this
process, which turns it into one drain) and die with this process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import wait
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, Callable

from prelude.config import EngineConfig
from prelude.entrypoints.multiproc.engine_proc import engine_main
from prelude.entrypoints.multiproc.front_proc import FrontSettings, RayReplicas, front_main

logger = logging.getLogger("prelude.supervisor")

# After the engine died, the HTTP processes get this long to answer and exit on their own.
_FRONT_EXIT_S = 15.0


@dataclass(frozen=True)
class RayEngines:
    """--data-parallel-size and friends: Ray replicas run the engines instead of one engine process."""

    cluster: Any  # prelude.cluster.launch.ClusterConfig
    factory: Callable[[], Any]
    decode_factory: Callable[[], Any] | None = None


class Supervisor:
    def __init__(self, config: EngineConfig, count: int, host: str, port: int, settings: dict[str, object],
                 ray_engines: RayEngines | None = None) -> None:
        self.config, self.count, self.host, self.port = config, count, host, port
        self.settings = settings
        self.ray_engines = ray_engines
        self._stopping = False
        self._fronts: list[BaseProcess] = []
        self._replicas: list[Any] = []

    def _signal(self, sig: int, frame: FrameType | None) -> None:
        if self._stopping:
            logger.warning("second %s: stopping every process now", signal.Signals(sig).name)
            for p in self._fronts:
                if p.is_alive():
                    p.kill()
            return
        self._stopping = True
        logger.info("%s: draining %d api servers", signal.Signals(sig).name, len(self._fronts))
        for p in self._fronts:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    def run(self) -> int:
        workdir = tempfile.mkdtemp(prefix="prelude-serve-")
        metrics_dir = os.path.join(workdir, "metrics")
        os.mkdir(metrics_dir)
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads
        listener = socket.create_server((self.host, self.port), backlog=2048)
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        engine: BaseProcess | None = None
        try:
            if self.ray_engines is not None:
                # Ray's own processes start before the variable exists: their metrics are Ray's.
                ray_spec, engine_path, engine_pid = self._start_ray_replicas(), None, None
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
                signal.signal(signal.SIGTERM, self._signal)  # ray.init installed its own (an abort)
                signal.signal(signal.SIGINT, self._signal)
            else:
                # Before any child starts: prometheus_client picks its multiprocess mode at import.
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
                engine_path = os.path.join(workdir, "engine.sock")
                engine, ready = self._start_engine(ctx, engine_path)
                ray_spec, engine_pid = None, engine.pid
            front_settings = FrontSettings(model=self.config.model, engine_path=engine_path, engine_pid=engine_pid,
                                           ray=ray_spec, count=self.count, **self.settings)  # type: ignore[arg-type]
            for i in range(self.count):
                p = ctx.Process(target=front_main, name=f"prelude-api-{i}", args=(i, listener, front_settings))
                p.start()
                self._fronts.append(p)
            listener.close()  # the HTTP processes hold it now
            # The HTTP processes import and load their tokenizers while the engine loads;
            # each connects once the engine's socket listens.
            if engine is not None and not self._await_engine(engine, ready):
                return 1
            logger.info("ready: %d api servers on http://%s:%d over %s", self.count, self.host, self.port,
                        f"engine process {engine_pid}" if engine is not None else "Ray replicas")
            return self._watch(engine)
        finally:
            for p in [*self._fronts, *([engine] if engine is not None else [])]:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
            if self.ray_engines is not None:
                import ray

                ray.shutdown()  # the replicas are this driver's actors: they go with it
            shutil.rmtree(workdir, ignore_errors=True)

    def _start_engine(self, ctx: Any, path: str) -> tuple[BaseProcess, Any]:
        """The engine process, started, and the pipe on which it says it is ready."""
        ready_r, ready_w = ctx.Pipe(duplex=False)
        log_level, log_format = str(self.settings["log_level"]), str(self.settings["log_format"])
        engine = ctx.Process(target=engine_main, name="prelude-engine",
                             args=(self.config, path, ready_w, log_level, log_format))
        engine.start()
        ready_w.close()
        return engine, ready_r

    def _start_ray_replicas(self) -> RayReplicas:
        """Ray replicas as named actors, each HTTP process joins them with its own client."""
        import uuid

        import ray

        from prelude.cluster.launch import ensure_ray, start_replicas

        spec = self.ray_engines
        assert spec is not None
        cluster = spec.cluster
        namespace = f"prelude-{uuid.uuid4().hex[:12]}"
        ensure_ray(cluster.ray_address, cluster.num_replicas * cluster.cpus_per_replica, namespace=namespace)
        names = tuple(f"replica-{i}" for i in range(cluster.num_replicas))
        replicas = start_replicas(spec.factory, cluster, int(self.settings["seed"]),  # type: ignore[call-overload]
                                  spec.decode_factory, names=list(names))
        ray.get([r.info.remote() for r in replicas])  # every replica built its engine
        self._replicas = replicas  # Ray ends an actor whose owner dropped every handle
        return RayReplicas(ray.get_runtime_context().gcs_address, namespace, names, cluster)

    def _await_engine(self, engine: BaseProcess, ready: object) -> bool:
        while True:
            if self._stopping:
                return False
            done = wait([ready, engine.sentinel], timeout=0.5)  # type: ignore[list-item]
            if ready in done:
                try:
                    status, detail = ready.recv()  # type: ignore[attr-defined]
                except EOFError:
                    status, detail = "error", f"exit code {engine.join(5) or engine.exitcode}"
                if status == "ready":
                    return True
                logger.error("the engine process failed to start: %s", detail)
                return False
            if engine.sentinel in done:
                logger.error("the engine process exited during start-up (exit code %s)", engine.exitcode)
                return False

    def _watch(self, engine: BaseProcess | None) -> int:
        """Until every HTTP process is down, then stop the engine; the exit code. (Ray
        replicas, `engine` None, are restarted by Ray and stopped with the driver.)"""
        code, exited = 0, set()
        while True:
            if engine is not None and not engine.is_alive():
                logger.error("the engine process exited (exit code %s); the api servers fail their requests",
                             engine.exitcode)
                self._join_all(self._fronts, _FRONT_EXIT_S)
                return 1
            live = [p for p in self._fronts if p.is_alive()]
            for p in self._fronts:
                if p.is_alive() or p.name in exited:
                    continue
                exited.add(p.name)
                code = code or int(p.exitcode != 0)
                if not self._stopping:  # nobody asked it to stop: stop the others too
                    logger.error("api server %s exited (exit code %s); stopping the others", p.name, p.exitcode)
                    code = 1
                    self._signal(signal.SIGTERM, None)
            if not live:
                break
            wait([*([engine.sentinel] if engine is not None else []), *(p.sentinel for p in live)], timeout=1.0)
        if engine is None:
            return code
        engine.terminate()  # SIGTERM: the engine process stops its loop and exits 0
        engine.join(timeout=30)
        return code or int(engine.exitcode != 0)

    @staticmethod
    def _join_all(procs: list[BaseProcess], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
