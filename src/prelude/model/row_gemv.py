"""One float32 row through a wide float32 weight (row_gemv.c), built once per machine
(model/native_lib.py) and called through ctypes. Projection takes it for one-row calls
of weights of at least ROW_GEMV_MIN_BYTES (an LM head), where oneDNN's packed one-row
kernel streamed the weight ~1.3x slower; `load_row_gemv()` is None without a compiler,
without AVX-512, or with PRELUDE_ROW_GEMV=0.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prelude.model import native_lib

_SOURCE = Path(__file__).with_name("row_gemv.c")
# Weights this large are read from memory, not from cache, on every call: where the
# kernel's streaming read pays. Smaller ones (a decoder layer's projections) keep oneDNN.
ROW_GEMV_MIN_BYTES = 4 << 20


class RowGemv:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.prelude_row_gemv_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int]
        self._fn = fn

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether one-row calls over `weight` [out, k] run here."""
        return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.is_contiguous() and weight.shape[1] % 16 == 0
                and weight.numel() * 4 >= ROW_GEMV_MIN_BYTES)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [k] or [1, k] float32 -> [out] or [1, out]: W x (+ bias); `weight` as `takes` allows."""
        out_features, k = weight.shape
        row = x.reshape(-1)
        if row.numel() != k or x.dtype != torch.float32:
            raise ValueError(f"row GEMV takes one float32 row of {k}, got {x.dtype} {tuple(x.shape)}")
        row = row.contiguous()
        if bias is not None:
            bias = bias.contiguous()
            if bias.dtype != torch.float32 or bias.numel() != out_features:
                raise ValueError(f"a bias of {bias.dtype} x {bias.numel()} for {out_features} float32 outputs")
        y = torch.empty(out_features, dtype=torch.float32)
        rc = self._fn(row.data_ptr(), weight.data_ptr(), out_features, k, None if bias is None else bias.data_ptr(),
                      y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"row GEMV refused its arguments ({out_features}x{k})")
        return y.reshape(*x.shape[:-1], out_features)


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def load_row_gemv() -> RowGemv | None:
    """The kernel, built on first use on this machine; None where it cannot run."""
    lib = native_lib.load(_SOURCE, "PRELUDE_ROW_GEMV", "one-row float32 GEMV of LM heads (oneDNN serves them)")
    if lib is None:
        return None
    available = lib.prelude_row_gemv_available
    available.restype = ctypes.c_int
    return RowGemv(lib) if available() else None
