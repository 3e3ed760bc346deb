"""Build and load the model's small C libraries (blocks_gemm.c, cpu_fused.c).

Each C file is compiled with the system C compiler on first use (~1 s) into the user's
cache dir, keyed by the source, the compiler and the flags; later processes load the
cached library. `make install` builds them ahead. The libraries link the OpenMP runtime
torch has already loaded (same soname), so their parallel loops run on the calling
thread's team instead of starting a second pool; ctypes releases the GIL for a call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("prelude.model.native_lib")

FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")


def _cache_dir() -> Path:
    from prelude.model.loader import cache_root  # the loader owns the cache layout

    return cache_root() / "kernels"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(source: Path, cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256("\n".join([source.read_text(), version, " ".join(FLAGS)]).encode()).hexdigest()[:16]
    return _cache_dir() / f"{source.stem}-{h}.so"


def build(source: Path) -> Path:
    """Compile `source` into the cache (atomically) unless it is there; the library's path."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc, or $CC)")
    target = library_path(source, cc)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, str(source), "-o", str(out)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


def cpu_has_avx2_fma() -> bool:
    # torch's AVX2 level requires FMA as well; every level above it includes both.
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")


def load(source: Path, switch: str, what: str) -> ctypes.CDLL | None:
    """`source`'s library, built on first use on this machine; None (with a log line naming
    `what` is off) when the environment variable `switch` is "0", without AVX2+FMA, or when
    it cannot be built or loaded. Loading an already built library is a dlopen."""
    if os.environ.get(switch, "1") == "0":
        return None
    if not cpu_has_avx2_fma():
        logger.info("%s off: this CPU has no AVX2+FMA", what)
        return None
    try:
        return ctypes.CDLL(str(build(source)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("%s off: %s", what, exc)
        return None
