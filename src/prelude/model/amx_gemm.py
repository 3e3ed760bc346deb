"""Many bfloat16 rows through a packed bfloat16 weight (amx_gemm.c), built once per machine
(model/native_lib.py) and called through ctypes: a bf16 prefill's projections on the AMX
tile unit, or, on a CPU with AVX512-BF16 and no AMX (AMD Zen 4 on), with vdpbf16ps over
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

from prelude.model import native_lib

_SOURCE = Path(__file__).with_name("amx_gemm.c")
WIDTH_STEP = 32  # out and k must be multiples of this


FORMS = ("", "dot-product", "AMX")  # prelude_amx_gemm_ready()'s answers
# The most rows a call takes here, per form (oneDNN's packed copies serve longer calls):
# - AMX: SmolLM2-135M prefills of 64 and 128 tokens 0.77-0.94x oneDNN's time, but at 256,
#   512 and 2,048 rows 1.06-1.19x slower (its gate/up GEMM the loser; KVM Xeon, model 207).
# - dot-product: 256-, 512- and 1,024-token bf16 prefills 0.96x, 0.99x and 0.98x oneDNN's
#   time, the judge's 1,024-row steps (16 x 64 over a cached 1,024) 1.03-1.06x the req/s;
#   2,048 rows even (1.01x the time; KVM Zen 4, alternated in one process).
MAX_ROWS = {"AMX": 128, "dot-product": 1024}


class AmxGemm:
    """The loaded library, and the form its calls take here ("AMX" or "dot-product")."""

    dtype = torch.bfloat16  # what its calls take

    def __init__(self, lib: ctypes.CDLL, form: str) -> None:
        self.form = form
        self.max_rows = MAX_ROWS[form]  # bf16 calls past the few-row routes up to this many take it
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._pack = lib.prelude_amx_gemm_pack
        self._pack.restype = ctypes.c_int
        self._pack.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
        self._fn = lib.prelude_amx_gemm
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]

    @property
    def entry_point(self) -> int:
        """The address of prelude_amx_gemm (layer_loop.c may call it)."""
        return native_lib.address(self._fn)

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether calls through `weight` [out, k] can run here (bf16, both widths multiples of 32)."""
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] % WIDTH_STEP == 0 and weight.shape[1] % WIDTH_STEP == 0)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The copy of `weight` [out, k] the kernel reads: int32 words, 64-byte aligned."""
        if not self.takes(weight):
            raise ValueError(f"the AMX GEMM packs bf16 weights of widths divisible by {WIDTH_STEP}, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        w = weight.contiguous()
        # 16 words of slack to start the copy on a 64-byte boundary (torch aligns to 64, but need not)
        store = torch.empty(w.numel() // 2 + 16, dtype=torch.int32)
        skip = (-store.data_ptr() % 64) // 4
        packed = store[skip:skip + w.numel() // 2]
        if self._pack(w.data_ptr(), w.shape[0], w.shape[1], packed.data_ptr(), torch.get_num_threads()) != 0:
            raise RuntimeError(f"the AMX GEMM's packing refused {tuple(w.shape)}")
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, k] bf16 (unit stride along k) -> [rows, out_features]: x W^T (+ bias),
        float32 sums rounded once to bf16; `packed` from pack(W)."""
        if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.shape[0] < 1:
            raise ValueError(f"the AMX GEMM takes [rows, k] bf16 rows, got {x.dtype} {tuple(x.shape)}")
        m, k = x.shape
        if packed.numel() * 2 != out_features * k:
            raise ValueError(f"a packed weight of {packed.numel() * 2} for {out_features} x {k}")
        if bias is not None:
            bias = bias.contiguous()
            if bias.dtype != torch.bfloat16 or bias.numel() != out_features:
                raise ValueError(f"a bias of {bias.dtype} x {bias.numel()} for {out_features} bf16 outputs")
        y = torch.empty(m, out_features, dtype=torch.bfloat16)
        rc = self._fn(x.data_ptr(), m, x.stride(0), packed.data_ptr(), out_features, k,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"the AMX GEMM refused its arguments ({m} rows, {out_features}x{k})")
        return y


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def load_amx_gemm() -> AmxGemm | None:
    """The kernel, built on first use on this machine; None where it cannot run."""
    lib = native_lib.load(_SOURCE, "PRELUDE_AMX_GEMM", "bf16 prefill GEMMs (oneDNN serves them)")
    if lib is None:
        return None
    ready = lib.prelude_amx_gemm_ready
    ready.restype = ctypes.c_int
    form = FORMS[ready()]
    return AmxGemm(lib, form) if form else None
