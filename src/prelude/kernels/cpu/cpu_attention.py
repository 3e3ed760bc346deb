"""The thin wrapper of cpu_attention.c: builds and loads the library for this CPU
(native_lib.py) and declares its entry points; model/attention/cpu_backend.py is the
attention backend over it."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("cpu_attention.c")
# The shared flags without -ffp-contract=off: this kernel's a * b + c are meant as FMAs (its
# numerics follow no eager op's roundings; an online softmax reorders them anyway).
FLAGS = tuple(f for f in native_lib.FLAGS if f != "-ffp-contract=off")
MAX_HEAD_DIM = 4096  # the C side's per-row scratch
# prelude_paged_attention's option bits
OPT_AMX = 1
OPT_ALL_WIDE = 2


@dataclass(frozen=True)
class CpuAttentionKernel:
    """The library's entry points, declared: `attend` (prelude_paged_attention), `write`
    (prelude_write_kv), and what this build and process can run."""

    attend: ctypes._CFuncPtr  # type: ignore[name-defined]
    write: ctypes._CFuncPtr  # type: ignore[name-defined]
    bf16_forms: bool  # bf16 tensors take the AVX512-BF16 dot-product forms
    amx_ready: bool  # the AMX tile forms are built and the OS grants the tiles

    @property
    def attend_address(self) -> int:
        """The address of prelude_paged_attention (layer_loop.c calls it)."""
        return native_lib.address(self.attend)


def declare(lib: ctypes.CDLL) -> CpuAttentionKernel:
    i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    attend = lib.prelude_paged_attention
    attend.argtypes = [
        ptr, i64, i64, ptr, i64, i64, ptr, i64, i64,  # q, k, v
        ptr, ptr, i64, i64, i64, i64,  # caches, strides, block size
        i64, ptr, ptr, ptr, ptr, ptr, i64, ptr,  # prefill rows (the last: tail queries)
        i64, ptr, ptr, ptr, i64,  # decode rows
        ptr, ptr, i64,  # segments, slots (the KV write)
        ptr, i64, i64,  # out
        i64, i64, i64, f32, c_int, c_int, c_int,
        i64,  # window (0: none)
    ]
    write = lib.prelude_write_kv
    write.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, ptr, i64, i64, i64, i64, c_int]
    for fn in (attend, write):
        fn.restype = c_int
    return CpuAttentionKernel(attend, write, bool(lib.prelude_attention_bf16_forms()),
                              bool(lib.prelude_attention_amx_ready()))


def build() -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, FLAGS)


def load_cpu_attention_kernel() -> CpuAttentionKernel | None:
    """The kernel, built on first use on this machine; None where it cannot run (no compiler,
    no AVX2+FMA, PRELUDE_CPU_ATTENTION=0)."""
    lib = native_lib.load(_SOURCE, "PRELUDE_CPU_ATTENTION", "CPU paged attention (torch SDPA serves instead)", FLAGS)
    return None if lib is None else declare(lib)
