"""How to start each benchmark peer, and which scenarios it can serve.

A peer that cannot run here (a package missing, no python given) raises
PeerUnavailable with the reason; the benchmark prints it and goes on without that peer.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

COMPLETIONS, CLASSIFY, EMBEDDINGS = "completions", "classify", "embeddings"
PEER_NAMES = ("prelude", "transformers", "llama.cpp", "prelude-embed", "sentence-transformers")


class PeerUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class PeerOptions:
    dtype: str = "bfloat16"
    llama_python: str | None = None  # a python with llama-cpp-python[server]
    threads: int = 0  # 0: every core (what each server does by default)
    llama_ctx: int = 4096  # the shared-prefix preset needs 3,072 + 768 + 1


@dataclass(frozen=True)
class PeerSpec:
    name: str
    command: tuple[str, ...]
    ready_path: str
    model: str | None  # the request's "model" field; None: leave it out
    serves: frozenset[str]


def _has_module(python: str, module: str) -> bool:
    if python == sys.executable:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing
            return False
    try:
        done = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=120)
    except OSError:  # no such python
        return False
    return done.returncode == 0


def peer_spec(name: str, port: int, opts: PeerOptions) -> PeerSpec:
    py, p = sys.executable, str(port)
    if name == "prelude":
        return PeerSpec(name, (py, "-m", "prelude.cli", "serve", "--port", p, "--log-level", "warning",
                               "--dtype", opts.dtype), "/health", "SmolLM2-135M-Instruct",
                        frozenset({COMPLETIONS, CLASSIFY}))
    if name == "prelude-embed":
        return PeerSpec(name, (py, "-m", "prelude.cli", "serve", "--port", p, "--log-level", "warning",
                               "--model", "all-MiniLM-L6-v2", "--dtype", "float32"), "/health", "all-MiniLM-L6-v2",
                        frozenset({EMBEDDINGS}))
    if name == "transformers":
        return PeerSpec(name, (py, "-m", "prelude.bench.peers.transformers_server", "--port", p, "--dtype",
                               opts.dtype), "/health", None, frozenset({COMPLETIONS, CLASSIFY}))
    if name == "sentence-transformers":
        if not _has_module(py, "sentence_transformers"):
            raise PeerUnavailable("sentence-transformers is not installed: pip install sentence-transformers")
        return PeerSpec(name, (py, "-m", "prelude.bench.peers.st_server", "--port", p), "/health", None,
                        frozenset({EMBEDDINGS}))
    if name == "llama.cpp":
        python = opts.llama_python or (sys.executable if _has_module(sys.executable, "llama_cpp") else None)
        if python is None:
            raise PeerUnavailable(
                "llama-cpp-python is not installed here: put `llama-cpp-python[server]` in a separate venv "
                "(it compiles llama.cpp, ~4-10 min) and pass --llama-python /that/venv/bin/python")
        if not _has_module(python, "llama_cpp.server"):
            raise PeerUnavailable(f"{python} can not import llama_cpp.server")
        from prelude.model.loader import default_model_path

        threads = str(opts.threads or _cores())
        # interrupt_requests defaults to True: a new request would cancel the one being
        # served (streams cut mid-way under concurrency). Queue them instead, like a server should.
        return PeerSpec(name, (python, "-m", "llama_cpp.server", "--model", str(default_model_path()),
                               "--host", "127.0.0.1", "--port", p, "--n_ctx", str(opts.llama_ctx),
                               "--n_threads", threads, "--n_threads_batch", threads,
                               "--interrupt_requests", "False"),
                        "/v1/models", None, frozenset({COMPLETIONS}))
    raise PeerUnavailable(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
