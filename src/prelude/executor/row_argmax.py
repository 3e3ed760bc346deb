"""`row_argmax(x)`: torch.argmax(x, dim=-1) of float32 CPU rows, through a small C kernel
(row_argmax.c). torch's CPU argmax tracks an index per element and does not vectorize:
27 us for one 49,152-wide row, 1.7 ms for 64, ~10x its own max reduction. Greedy
sampling takes an argmax per sampled row every step, so decode of a large vocabulary
paid for it at every token. The same answer (the first of equal maxima; a NaN is the
maximum), any other device, dtype or layout goes to torch. Built on first use like the
model's C kernels (model/native_lib.py); PRELUDE_ROW_ARGMAX=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prelude.model import native_lib

_SOURCE = Path(__file__).with_name("row_argmax.c")


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.prelude_row_argmax
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, i64, i64, i64, ptr]
        self._fn.restype = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, n = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._fn(x.data_ptr(), rows, n, x.stride(0), out.data_ptr())
        return out


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def _kernel() -> _Kernel | None:
    lib = native_lib.load(_SOURCE, "PRELUDE_ROW_ARGMAX", "the C row argmax (sampling uses torch.argmax)")
    return None if lib is None else _Kernel(lib)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension of a 2-D tensor: int64 [rows]."""
    kernel = _kernel() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if kernel is None or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1 or x.requires_grad:
        return x.argmax(-1)
    return kernel(x)
