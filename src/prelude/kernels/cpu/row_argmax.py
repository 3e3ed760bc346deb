"""The sampler's per-row argmaxes over float32 CPU rows, through a small C kernel
(row_argmax.c); any other device, dtype or layout goes to torch.

- `row_argmax(x)`: torch.argmax(x, dim=-1). torch's CPU argmax tracks an index per
  element and does not vectorize, so it takes several times its own max reduction, paid
  at every greedy token. The same answer (the first of equal maxima; a NaN is the
  maximum).
- `race_argmax(probs, seeds, positions)`: the exponential race of sampler.py, argmax of
  probs / -log(uniform_noise(seeds, positions)), without the [rows, vocab] noise: the C
  side hashes each token's uniform as uniform_noise does and skips the log of tokens
  that cannot win. The same values as the torch expression, up to the last bit of log
  (glibc's against torch's vectorized one), which a float32 rounding almost never shows.
  At temperature 1 (OpenAI's default) this ran at every sampled token.

Built on first use like the model's C kernels (kernels/cpu/native_lib.py); PRELUDE_ROW_ARGMAX=0
turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

import torch

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("row_argmax.c")


class _Kernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.prelude_row_argmax
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, i64, i64, i64, ptr]
        self._fn.restype = None
        self._race = lib.prelude_race_argmax
        self._race.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
        self._race.restype = None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        rows, n = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._fn(x.data_ptr(), rows, n, x.stride(0), out.data_ptr())
        return out

    def race(self, probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows, n = probs.shape
        seeds, positions = seeds.contiguous(), positions.contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        self._race(probs.data_ptr(), rows, n, probs.stride(0), seeds.data_ptr(), positions.data_ptr(), out.data_ptr())
        return out


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def _kernel() -> _Kernel | None:
    lib = native_lib.load(_SOURCE, "PRELUDE_ROW_ARGMAX", "the C row argmax (sampling uses torch.argmax)")
    return None if lib is None else _Kernel(lib)


def _kernel_for(x: torch.Tensor) -> _Kernel | None:
    """The kernel when it takes `x` (float32 CPU rows with unit column stride), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        return None
    return _kernel() if x.stride(1) == 1 and not x.requires_grad else None


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension of a 2-D tensor: int64 [rows]."""
    kernel = _kernel_for(x)
    return x.argmax(-1) if kernel is None else kernel.argmax(x)


def race_argmax(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                noise: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """argmax of probs / -log(noise(seeds, positions, vocab)) per row ([rows, vocab]
    probabilities, int64 [rows] seeds and output positions): int64 [rows]. `noise` is
    the uniform noise the torch path draws (sampler.uniform_noise) where the kernel
    does not serve."""
    kernel = _kernel_for(probs)
    if kernel is None or seeds.device.type != "cpu" or positions.device.type != "cpu":
        race = probs / -torch.log(noise(seeds, positions, probs.shape[1])).to(probs.dtype)
        return row_argmax(race)
    return kernel.race(probs, seeds.to(torch.int64), positions.to(torch.int64))
