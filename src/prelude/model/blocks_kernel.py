"""The few-row GEMM over GGUF blocks (blocks_gemm.c), built once per machine
(model/native_lib.py) and called through ctypes. Without a compiler or an AVX2+FMA CPU,
`load_kernel()` returns None and projections keep their float32 path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from prelude.model import native_lib
from prelude.model.ggml_blocks import KINDS, GgmlBlocks

_SOURCE = Path(__file__).with_name("blocks_gemm.c")


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


def build() -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE)


def load_kernel() -> BlocksKernel | None:
    """The kernel, built on first use on this machine; None where it cannot run. Each
    caller (a model) holds its own handle."""
    lib = native_lib.load(_SOURCE, "PRELUDE_BLOCKS_KERNEL", "GGUF-block decode GEMM (decode reads float32 weights)")
    return None if lib is None else BlocksKernel(lib)
