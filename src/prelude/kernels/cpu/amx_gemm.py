"""Many bfloat16 rows through a packed bfloat16 weight (amx_gemm.c), built once per machine
(kernels/cpu/native_lib.py) and called through ctypes: a bf16 prefill's projections on the AMX
tile unit, or, on a CPU with AVX512-BF16 and no AMX (recent AMD CPUs), with vdpbf16ps over
the same packed copy (its `form`).

`pack(weight)` makes the copy the kernel reads (the weight's bytes again, in k pairs, 16
outputs a block), `linear(x, packed, bias)` runs it. A row's sums run in one order
whatever the thread count and the other rows of the call. `load_amx_gemm()` is None
without a compiler, without AVX512-BF16 (and AMX-BF16 or the kernel's permission to use
it), or with PRELUDE_AMX_GEMM=0.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.packed_gemm import PackedGemm

_SOURCE = Path(__file__).with_name("amx_gemm.c")
WIDTH_STEP = 32  # out and k must be multiples of this


FORMS = ("", "dot-product", "AMX")  # prelude_amx_gemm_ready()'s answers
# The most rows a call takes here, per form (oneDNN's packed copies serve longer calls):
# - AMX: short prefills beat oneDNN, but from a few hundred rows on oneDNN's blocking of the
#   wide gate/up GEMM wins, so the tile form stops at 128 rows.
# - dot-product: at least even with oneDNN up to 2,048 rows (prefills and the judge's
#   1,024-row steps), so the C layer loop can take those steps too.
# The measurements behind these bounds are in docs/benchmarks.md.
MAX_ROWS = {"AMX": 128, "dot-product": 2048}


class AmxGemm(PackedGemm):
    """The loaded library, and the form its calls take here ("AMX" or "dot-product")."""

    dtype = torch.bfloat16
    packed_dtype = torch.int32  # two bf16 (a k pair) a word
    align = 64
    what = "the AMX GEMM"

    def __init__(self, lib: ctypes.CDLL, form: str) -> None:
        super().__init__(lib, "prelude_amx_gemm")
        self.form = form
        self.max_rows = MAX_ROWS[form]  # bf16 calls past the few-row routes up to this many take it

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether calls through `weight` [out, k] can run here (bf16, both widths multiples of 32)."""
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] % WIDTH_STEP == 0 and weight.shape[1] % WIDTH_STEP == 0)


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def load_amx_gemm() -> AmxGemm | None:
    """The kernel, built on first use on this machine; None where it cannot run."""
    lib = native_lib.load(_SOURCE, "PRELUDE_AMX_GEMM", "bf16 prefill GEMMs (oneDNN serves them)")
    if lib is None:
        return None
    form = FORMS[native_lib.answer(lib, "prelude_amx_gemm_ready")]
    return AmxGemm(lib, form) if form else None
