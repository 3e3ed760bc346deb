"""Many float32 rows through a packed float32 weight (f32_gemm.c, AVX2 + FMA), built once per
machine (model/native_lib.py) and called through ctypes: a float32 prefill's projections on
a CPU without AVX-512, where float32 is `--dtype auto`'s choice and oneDNN's kernels ran
SmolLM2-135M's projections at ~70% of the FMA peak.

`pack(weight)` makes the copy the kernel reads (the weight's bytes again, 8 outputs a
block), `linear(x, packed, bias)` runs it. A row's sums run in one order whatever the thread
count and the other rows of the call. `load_f32_gemm()` is None without a compiler, on a
CPU with AVX-512 (oneDNN's AVX-512 kernels serve there), or with PRELUDE_F32_GEMM=0.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prelude.model import native_lib

_SOURCE = Path(__file__).with_name("f32_gemm.c")
WIDTH_STEP = 8  # out must be a multiple of this
# The most rows a call takes here (oneDNN's packed copies serve longer calls). SmolLM2-135M's
# 120 projections, a KVM Zen 4 capped to AVX2, alternated with oneDNN's packed kernels:
# 0.87x their time at 128 rows, 0.93x at 1,024 (docs/benchmarks.md, twenty-fifth session).
MAX_ROWS = 1024


class F32Gemm:
    """The loaded library."""

    max_rows = MAX_ROWS
    dtype = torch.float32  # what its calls take

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._pack = lib.prelude_f32_gemm_pack
        self._pack.restype = ctypes.c_int
        self._pack.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
        self._fn = lib.prelude_f32_gemm
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether calls through `weight` [out, k] can run here (float32, out a multiple of 8)."""
        return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] % WIDTH_STEP == 0 and weight.shape[1] > 0)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The copy of `weight` [out, k] the kernel reads: float32, 32-byte aligned."""
        if not self.takes(weight):
            raise ValueError(f"the float32 GEMM packs float32 weights of a width divisible by {WIDTH_STEP}, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        w = weight.contiguous()
        store = torch.empty(w.numel() + 8, dtype=torch.float32)  # slack to start on a 32-byte boundary
        skip = (-store.data_ptr() % 32) // 4
        packed = store[skip:skip + w.numel()]
        if self._pack(w.data_ptr(), w.shape[0], w.shape[1], packed.data_ptr(), torch.get_num_threads()) != 0:
            raise RuntimeError(f"the float32 GEMM's packing refused {tuple(w.shape)}")
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, k] float32 (unit stride along k) -> [rows, out_features]: x W^T (+ bias);
        `packed` from pack(W)."""
        if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[0] < 1:
            raise ValueError(f"the float32 GEMM takes [rows, k] float32 rows, got {x.dtype} {tuple(x.shape)}")
        m, k = x.shape
        if packed.numel() != out_features * k:
            raise ValueError(f"a packed weight of {packed.numel()} for {out_features} x {k}")
        if bias is not None:
            bias = bias.contiguous()
            if bias.dtype != torch.float32 or bias.numel() != out_features:
                raise ValueError(f"a bias of {bias.dtype} x {bias.numel()} for {out_features} float32 outputs")
        y = torch.empty(m, out_features, dtype=torch.float32)
        rc = self._fn(x.data_ptr(), m, x.stride(0), packed.data_ptr(), out_features, k,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"the float32 GEMM refused its arguments ({m} rows, {out_features}x{k})")
        return y


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def load_f32_gemm() -> F32Gemm | None:
    """The kernel, built on first use on this machine; None where it does not serve."""
    if "avx512_f" in native_lib.cpu_isa_flags():
        return None
    lib = native_lib.load(_SOURCE, "PRELUDE_F32_GEMM", "float32 prefill GEMMs (oneDNN serves them)")
    if lib is None:
        return None
    ready = lib.prelude_f32_gemm_ready
    ready.restype = ctypes.c_int
    return F32Gemm(lib) if ready() else None
