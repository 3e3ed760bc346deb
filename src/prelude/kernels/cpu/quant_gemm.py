"""The few-row GEMM over GGUF blocks (quant_gemm.c), built once per machine
(kernels/cpu/native_lib.py) and called through ctypes: float32 activations on any AVX2+FMA CPU,
bf16 activations where the CPU has AVX512-BF16 (`QuantKernel.bf16`). Without a compiler
or an AVX2+FMA CPU, `load_kernel()` returns None and projections keep their dense path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from prelude.kernels.cpu import native_lib
from prelude.kernels.ggml_quants import KINDS, GgmlQuants

_SOURCE = Path(__file__).with_name("quant_gemm.c")


class QuantKernel:
    """The loaded library. Keeps the per-call Python work small: a decode step of a
    30-layer model makes ~120 calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.prelude_blocks_gemm
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_void_p]
        self._fn = fn
        # bf16 activations: built only where the compiler targeted AVX512-BF16 (this CPU has it)
        self.bf16 = bool(native_lib.answer(lib, "prelude_blocks_gemm_bf16_available"))
        self._fn_bf16 = None
        if self.bf16:
            self._fn_bf16 = lib.prelude_blocks_gemm_bf16
            self._fn_bf16.restype = ctypes.c_int
            self._fn_bf16.argtypes = fn.argtypes

    def entry_point(self, dtype: torch.dtype) -> int | None:
        """The address of the GEMM for `dtype` activations (layer_loop.c calls it); None where
        there is none (bf16 without AVX512-BF16, any other dtype)."""
        if dtype == torch.float32:
            return native_lib.address(self._fn)
        if dtype == torch.bfloat16 and self._fn_bf16 is not None:
            return native_lib.address(self._fn_bf16)
        return None

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether activations of `dtype` can read the blocks here."""
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.bf16)

    def linear(self, x: torch.Tensor, blocks: GgmlQuants, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] float32 (or bf16 where `takes` it) -> [..., N] in x's dtype: x W^T
        (+ bias, in x's dtype) with W in `blocks`."""
        k = blocks.in_features
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
        if not self.takes(rows.dtype) or rows.shape[1] != k:
            raise ValueError(f"blocks GEMM takes float32{' or bfloat16' if self.bf16 else ''} rows of {k}, "
                             f"got {rows.dtype} {tuple(rows.shape)}")
        if bias is not None and bias.dtype != rows.dtype:
            raise ValueError(f"a {bias.dtype} bias beside {rows.dtype} rows")
        m = rows.shape[0]
        out = torch.empty(m, blocks.out_features, dtype=rows.dtype)
        if m:
            scratch = torch.empty(m * k // 32, dtype=torch.float32)  # each x block's sum
            call = self._fn if rows.dtype == torch.float32 else self._fn_bf16
            rc = call(KINDS.index(blocks.kind), rows.data_ptr(), m, k, blocks.qs.data_ptr(),
                          blocks.d.data_ptr(), None if blocks.m is None else blocks.m.data_ptr(),
                          blocks.out_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
                          torch.get_num_threads(), scratch.data_ptr())
            if rc != 0:
                raise RuntimeError(f"blocks GEMM refused its arguments ({blocks.kind}, K={k})")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], blocks.out_features)


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


def load_kernel() -> QuantKernel | None:
    """The kernel, built on first use on this machine; None where it cannot run. Each
    caller (a model) holds its own handle."""
    lib = native_lib.load(_SOURCE, "PRELUDE_BLOCKS_KERNEL", "GGUF-block decode GEMM (decode reads float32 weights)")
    return None if lib is None else QuantKernel(lib)
