"""Many float32 rows through a packed float32 weight (f32_gemm.c, AVX2 + FMA), built once per
machine (kernels/cpu/native_lib.py) and called through ctypes: a float32 prefill's
projections on a CPU without AVX-512, where float32 is `--dtype auto`'s choice and oneDNN's
kernels leave part of the FMA peak unused.

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

from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.packed_gemm import PackedGemm

_SOURCE = Path(__file__).with_name("f32_gemm.c")
WIDTH_STEP = 8  # out must be a multiple of this
# The most rows a call takes here (oneDNN's packed copies serve longer calls): up to the
# default token budget's steps this kernel takes less time than oneDNN's packed kernels
# (docs/benchmarks.md).
MAX_ROWS = 2048


class F32Gemm(PackedGemm):
    """The loaded library."""

    max_rows = MAX_ROWS
    dtype = torch.float32
    packed_dtype = torch.float32
    align = 32
    what = "the float32 GEMM"

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib, "prelude_f32_gemm")

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether calls through `weight` [out, k] can run here (float32, out a multiple of 8)."""
        return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] % WIDTH_STEP == 0 and weight.shape[1] > 0)


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
    return F32Gemm(lib) if native_lib.answer(lib, "prelude_f32_gemm_ready") else None
