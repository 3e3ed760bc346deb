"""The few-row GEMM over GGUF blocks (blocks_gemm.c), built once per machine and called
through ctypes.

The C file is compiled with the system C compiler on first use (~1 s) into the user's
cache dir, keyed by the source, the compiler and the flags; later processes load the
cached library. `make install` builds it ahead. Without a compiler or an AVX2+FMA CPU,
`load_kernel()` returns None and projections keep their float32 path.

The library links the OpenMP runtime torch has already loaded (same soname), so its
parallel loop runs on the calling thread's team instead of starting a second pool.
ctypes releases the GIL for the call.
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

from prelude.model.ggml_blocks import KINDS, GgmlBlocks

logger = logging.getLogger("prelude.model.blocks_kernel")

_SOURCE = Path(__file__).with_name("blocks_gemm.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")


class BlocksKernel:
    """The loaded library. Keeps the per-call Python work small: a decode step of a
    30-layer model makes ~120 calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.prelude_blocks_gemm
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_void_p]
        self._fn = fn

    def linear(self, x: torch.Tensor, blocks: GgmlBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] float32 -> [..., N]: x W^T (+ bias) with W in `blocks`."""
        k = blocks.in_features
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
        if rows.dtype != torch.float32 or rows.shape[1] != k:
            raise ValueError(f"blocks GEMM takes float32 rows of {k}, got {rows.dtype} {tuple(rows.shape)}")
        m = rows.shape[0]
        out = torch.empty(m, blocks.out_features, dtype=torch.float32)
        if m:
            scratch = torch.empty(m * k // 32, dtype=torch.float32)  # each x block's sum
            rc = self._fn(KINDS.index(blocks.kind), rows.data_ptr(), m, k, blocks.qs.data_ptr(),
                          blocks.d.data_ptr(), None if blocks.m is None else blocks.m.data_ptr(),
                          blocks.out_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
                          torch.get_num_threads(), scratch.data_ptr())
            if rc != 0:
                raise RuntimeError(f"blocks GEMM refused its arguments ({blocks.kind}, K={k})")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], blocks.out_features)


def _cache_dir() -> Path:
    from prelude.model.loader import cache_root  # the loader owns the cache layout

    return cache_root() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256("\n".join([_SOURCE.read_text(), version, " ".join(_FLAGS)]).encode()).hexdigest()[:16]
    return _cache_dir() / f"blocks_gemm-{h}.so"


def build() -> Path:
    """Compile the library into the cache (atomically) unless it is there; its path."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc, or $CC)")
    target = library_path(compiler)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(out)], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


def _cpu_ok() -> bool:
    # torch's AVX2 level requires FMA as well; every level above it includes both.
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")


def load_kernel() -> BlocksKernel | None:
    """The kernel, built on first use on this machine; None where it cannot run. Each
    caller (a model) holds its own handle: loading an already built library is a dlopen."""
    if os.environ.get("PRELUDE_BLOCKS_KERNEL", "1") == "0":
        return None
    if not _cpu_ok():
        logger.info("GGUF-block decode GEMM off: this CPU has no AVX2+FMA")
        return None
    try:
        return BlocksKernel(ctypes.CDLL(str(build())))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("GGUF-block decode GEMM off (decode reads float32 weights): %s", exc)
        return None
