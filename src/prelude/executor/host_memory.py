"""Keep freed activation memory in the process on the CPU instead of giving it back each step.

A CPU forward allocates its activations through malloc: a 2,048-token step of SmolLM2
makes tensors of 2-13 MB (the MLP's gate/up output alone is 12.6 MB in bf16) and frees
them before the next layer. glibc serves allocations above its mmap threshold with fresh
mappings and unmaps them on free, and trims the heap's free top above its trim threshold,
so every step faulted the same pages in again: tens of thousands of minor faults a judge
wave, a noticeable share of its time. With the mmap threshold at glibc's largest (32 MiB)
and a trim threshold of TRIM_BYTES, those tensors come from the heap and stay there, and
the faults mostly go. The price is that a process keeps up to TRIM_BYTES of freed heap
above its live memory; a larger trim threshold kept more in a long run-batch job than
the untuned default, TRIM_BYTES less.

Set once, at the CPU runner's creation, through mallopt (glibc only: other C libraries,
or MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment, are left alone;
PRELUDE_MALLOC_TUNE=0 turns it off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger("prelude.executor.host_memory")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit (4 MiB x sizeof(long))
TRIM_BYTES = 64 << 20
SWITCH = "PRELUDE_MALLOC_TUNE"
_USER_SET = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_applied: bool | None = None


def keep_freed_activations() -> bool:
    """Apply the thresholds once per process; whether they are in force (False where not
    glibc, switched off, or set by the user)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(SWITCH, "1") == "0" or any(v in os.environ for v in _USER_SET):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    except (OSError, AttributeError):
        return False
    if _applied:
        logger.info("host memory: malloc keeps freed activations (mmap threshold %d MiB, trim threshold %d MiB)",
                    MMAP_BYTES >> 20, TRIM_BYTES >> 20)
    return _applied
