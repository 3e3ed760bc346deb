"""The greedy tokens of 1..64 rows (16 at a time) through a float32 LM head, without their logits
(head_argmax.c): a bfloat16 pass over a bfloat16 copy of the head bounds every logit, and
the few tokens that can still be the best are computed in float32 exactly as row_gemv.c's
kernels compute them (the ones Projection runs for such calls), so the token is
the argmax of the logits that path gives, bit for bit, ties to the lowest id. The bf16
pass reads half the bytes of the float32 head and no logits are written, so a greedy
decode step's head and argmax take about half the time (docs/benchmarks.md).

model/fast_paths/greedy_head.py says which heads it serves (where Projection would run
row_gemv.c), and only where AVX512_BF16 is there. The copy
(half the head's bytes) and the norms are made on the first call: a process that never
decodes greedily never holds them. PRELUDE_HEAD_ARGMAX=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.row_gemv import BLOCKED_MAX_ROWS, padded_to_blocks

_SOURCE = Path(__file__).with_name("head_argmax.c")
MAX_K = 1024  # the bound's constant covers sums of up to this many products (head_argmax.c)


class HeadArgmax:
    """One head's bfloat16 copy and row norms, and the kernel over them."""

    def __init__(self, fn: ctypes._CFuncPtr, weight: torch.Tensor) -> None:  # type: ignore[name-defined]
        self._fn = fn
        self.weight = weight
        out, k = weight.shape
        padded = padded_to_blocks(weight)
        nb = padded.shape[0] // 16
        # [nb][k/2][16][2]: for token 16b + l, its weights 2p and 2p + 1 side by side at [b][p][l].
        # torch's float32 -> bfloat16 conversion rounds to nearest even, as the bound assumes.
        self._blocked = padded.view(nb, 16, k // 2, 2).transpose(1, 2).contiguous().to(torch.bfloat16)
        # |w_j| in double, rounded up: the bound must never be below the true one.
        norms = torch.zeros(nb * 16, dtype=torch.float32)
        norms[:out] = (weight.double().norm(dim=1) * (1 + 2.0**-20)).float()
        self._norms = norms
        self._width = nb * 16
        # the bfloat16 pass's candidates ([16, width] upper bounds, then as many ids), kept:
        # a call writes a few of them, and no page is faulted in per call
        self._scratch: torch.Tensor | None = None

    def argmax(self, x: torch.Tensor, limit: int) -> torch.Tensor | None:
        """int64 [rows]: argmax over ids < `limit` of x [rows, k] W^T; None where the kernel
        declines (a non-finite input or logit: then the logits decide, NaN included). More
        than 16 rows go 16 at a time (each row's sums are its own: a chunk of one row is
        summed in the one-row kernel's order)."""
        if x.shape[0] > BLOCKED_MAX_ROWS:
            chunks = [self.argmax(chunk, limit) for chunk in x.split(BLOCKED_MAX_ROWS)]
            return None if any(c is None for c in chunks) else torch.cat(chunks)  # type: ignore[arg-type]
        rows = x.contiguous()
        m = rows.shape[0]
        out, k = self.weight.shape
        if self._scratch is None:
            self._scratch = torch.empty(2 * BLOCKED_MAX_ROWS, self._width, dtype=torch.float32)
        ids = torch.empty(m, dtype=torch.int64)
        rc = self._fn(rows.data_ptr(), m, self._blocked.data_ptr(), self.weight.data_ptr(), self._norms.data_ptr(),
                      out, k, limit, self._scratch.data_ptr(), ids.data_ptr(), torch.get_num_threads())
        if rc == 1:
            raise RuntimeError(f"head argmax refused its arguments ({m} rows, {out}x{k}, limit {limit})")
        return ids if rc == 0 else None


@functools.cache
def load_head_argmax_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = native_lib.load(_SOURCE, "PRELUDE_HEAD_ARGMAX", "the bfloat16-bounded greedy head (greedy takes the logits)")
    if lib is None:
        return None
    if not native_lib.answer(lib, "prelude_head_argmax_available"):
        return None
    fn = lib.prelude_head_argmax_f32
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int]
    return fn


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)
