"""A few bfloat16 rows through a plain bfloat16 weight (bf16_rows.c), built once per
machine (kernels/cpu/native_lib.py) and called through ctypes: decode's projections in bf16.

oneDNN's packed kernels pay a fixed cost per call before any work, as much for a 64 x 64
weight as for a 576 x 576 one, and a small model's decode step makes about a hundred such
calls. This kernel reads the plain weight the Projection already holds (no copy), 16
outputs at a time, each block's weight rows read from memory once for all the call's rows
(16-row groups, four to a pass). On a CPU with AMX-BF16 its tile form serves every bf16
call of up to TILE_MAX_ROWS rows whose k is a multiple of 32 (model/layers/linear.py); the
vector form (AVX512-BF16 dot products) sums the outputs past the last whole block, and is
what the C side runs without AMX, where no call takes it (the vector unit's bf16 rate did
not beat oneDNN there).
`load_bf16_rows()` is None without a compiler, without AVX512-BF16, or with
PRELUDE_BF16_ROWS=0.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("bf16_rows.c")
MAX_ROWS = 256  # the C side's bound
# Calls of up to this many rows take the tile form (model/layers/linear.py): past two
# 16-row groups a pass over a block is bound by the tile unit, where oneDNN's blocking does
# more with it (docs/benchmarks.md).
TILE_MAX_ROWS = 32
TILE_K = 32  # the tile form reads k in chunks of this many


class Bf16Rows:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.prelude_bf16_rows
        fn.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._fn = fn
        self._amx_ready = bool(native_lib.answer(lib, "prelude_bf16_rows_amx_ready"))

    @property
    def entry_point(self) -> int:
        """The address of prelude_bf16_rows (layer_loop.c calls it)."""
        return native_lib.address(self._fn)

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether calls through `weight` [out, k] can run here."""
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.is_contiguous())

    def tile_form_ready(self) -> bool:
        """Whether this build has the tile form and the OS lets this process use AMX."""
        return self._amx_ready

    def tile_form_takes(self, weight: torch.Tensor) -> bool:
        """Whether calls of up to TILE_MAX_ROWS rows through `weight` run the tile form (its
        whole 16-output blocks; the last few outputs on the vector unit)."""
        return self._amx_ready and self.takes(weight) and weight.shape[1] % TILE_K == 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               amx: bool = True) -> torch.Tensor:
        """x [..., k] bf16 of 1..MAX_ROWS rows -> [..., out]: x W^T (+ bias), float32 sums
        rounded once to bf16; `amx`: on the tile unit where it can run (else the vector unit)."""
        out_features, k = weight.shape
        rows = x.reshape(-1, k) if x.dim() != 2 else x
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        if x.dtype != torch.bfloat16 or x.shape[-1] != k or not 1 <= m <= MAX_ROWS:
            raise ValueError(f"bf16 rows take 1..{MAX_ROWS} bf16 rows of {k}, got {x.dtype} {tuple(x.shape)}")
        if bias is not None:
            bias = bias.contiguous()
            if bias.dtype != torch.bfloat16 or bias.numel() != out_features:
                raise ValueError(f"a bias of {bias.dtype} x {bias.numel()} for {out_features} bf16 outputs")
        y = torch.empty(m, out_features, dtype=torch.bfloat16)
        rc = self._fn(rows.data_ptr(), m, rows.stride(0), weight.data_ptr(), out_features, k,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(), int(amx))
        if rc != 0:
            raise RuntimeError(f"bf16 rows refused their arguments ({m} rows, {out_features}x{k})")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def load_bf16_rows() -> Bf16Rows | None:
    """The kernel, built on first use on this machine; None where it cannot run."""
    lib = native_lib.load(_SOURCE, "PRELUDE_BF16_ROWS", "bf16 few-row GEMMs (oneDNN serves them)")
    if lib is None:
        return None
    return Bf16Rows(lib) if native_lib.answer(lib, "prelude_bf16_rows_available") else None
