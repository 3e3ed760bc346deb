"""A few float32 rows through a wide float32 weight (row_gemv.c), built once per machine
(kernels/cpu/native_lib.py) and called through ctypes. An LM head's Projection takes it for
calls of up to BLOCKED_MAX_ROWS rows over weights of at least ROW_GEMV_MIN_BYTES (c=1 to 16):
one row reads the plain weight (rows of 64, 128 or 256 only), 2..16 rows a blocked copy made
on their first call (16 outputs a vector: each weight vector serves every row), which
streams the weight faster than oneDNN's packed kernels at these row counts.
`load_row_gemv()` is None without a compiler, without AVX-512, or with PRELUDE_ROW_GEMV=0.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("row_gemv.c")
# Weights this large are read from memory, not from cache, on every call: where the
# kernel's streaming read pays. Smaller ones (a decoder layer's projections) keep oneDNN.
ROW_GEMV_MIN_BYTES = 4 << 20
BLOCKED_MAX_ROWS = 16  # the accumulators of 16 rows fill half the AVX-512 registers
ONE_ROW_WIDTHS = (64, 128, 256)  # row_gemv.c's x-in-registers widths (see RowGemv.one_row_pays)


class RowGemv:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.prelude_row_gemv_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int]
        self._fn = fn
        blocked = lib.prelude_rows_gemm_blocked_f32
        blocked.restype = ctypes.c_int
        blocked.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._blocked = blocked

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether one-row calls over `weight` [out, k] run here."""
        return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.is_contiguous() and weight.shape[1] % 16 == 0
                and weight.numel() * 4 >= ROW_GEMV_MIN_BYTES)

    @staticmethod
    def one_row_pays(weight: torch.Tensor) -> bool:
        """Whether one row through `weight` beats oneDNN here: widths whose x the kernel holds
        in registers (64, 128, 256). For wider rows (SmolLM2's 576, 1,024) oneDNN is faster
        for one row, while 2-8 rows through the blocked copy stay faster at every width."""
        return weight.shape[1] in ONE_ROW_WIDTHS

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [k] or [1, k] float32 -> [out] or [1, out]: W x (+ bias); `weight` as `takes` allows."""
        out_features, k = weight.shape
        row = x.reshape(-1)
        if row.numel() != k or x.dtype != torch.float32:
            raise ValueError(f"row GEMV takes one float32 row of {k}, got {x.dtype} {tuple(x.shape)}")
        row = row.contiguous()
        bias = _checked_bias(bias, out_features)
        y = torch.empty(out_features, dtype=torch.float32)
        rc = self._fn(row.data_ptr(), weight.data_ptr(), out_features, k, None if bias is None else bias.data_ptr(),
                      y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"row GEMV refused its arguments ({out_features}x{k})")
        return y.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def block(weight: torch.Tensor) -> torch.Tensor:
        """The blocked copy of `weight` [out, k] that `rows_linear` reads: [ceil(out/16), k, 16],
        zero past `out`."""
        padded = padded_to_blocks(weight)
        return padded.view(padded.shape[0] // 16, 16, weight.shape[1]).transpose(1, 2).contiguous()

    def rows_linear(self, x: torch.Tensor, blocked: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., k] float32 of 2..BLOCKED_MAX_ROWS rows -> [..., out]: W x (+ bias), W's
        `block`ed copy given."""
        k = blocked.shape[1]
        rows = x.reshape(-1, k).contiguous()
        m = rows.shape[0]
        if not 2 <= m <= BLOCKED_MAX_ROWS or x.dtype != torch.float32 or x.shape[-1] != k:
            raise ValueError(f"blocked GEMM takes 2..{BLOCKED_MAX_ROWS} float32 rows of {k}, "
                             f"got {x.dtype} {tuple(x.shape)}")
        bias = _checked_bias(bias, out_features)
        y = torch.empty(m, out_features, dtype=torch.float32)
        rc = self._blocked(rows.data_ptr(), m, blocked.data_ptr(), out_features, k,
                           None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"blocked GEMM refused its arguments ({m} rows, {out_features}x{k})")
        return y.reshape(*x.shape[:-1], out_features)


def padded_to_blocks(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, k] as float32 with zero rows up to a multiple of 16 outputs (the kernels'
    block of 16 outputs a vector)."""
    return F.pad(weight.to(torch.float32), (0, 0, 0, -weight.shape[0] % 16))


def _checked_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    """`bias` contiguous, or ValueError unless it is `out_features` float32 values."""
    if bias is None:
        return None
    bias = bias.contiguous()
    if bias.dtype != torch.float32 or bias.numel() != out_features:
        raise ValueError(f"a bias of {bias.dtype} x {bias.numel()} for {out_features} float32 outputs")
    return bias


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def load_row_gemv() -> RowGemv | None:
    """The kernel, built on first use on this machine; None where it cannot run."""
    lib = native_lib.load(_SOURCE, "PRELUDE_ROW_GEMV", "one-row float32 GEMV of LM heads (oneDNN serves them)")
    if lib is None:
        return None
    return RowGemv(lib) if native_lib.answer(lib, "prelude_row_gemv_available") else None
