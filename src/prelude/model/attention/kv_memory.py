"""Zeroed KV-cache tensors, on the CPU one anonymous memory mapping.

The kernel guarantees the mapping reads as zeros. Zeros matter: attention masks unwritten
slots with probability 0, and 0 x (garbage NaN) would still be NaN. Left lazy, it is
backed with pages only when first written, and that first write is a page fault: a
prompt's K/V over every layer touches hundreds of new 4 KiB pages, a visible share of a
short request (and attention is slower until its pages are there), until every page of
the pool has been written once. So a serving engine's pool has its pages faulted in
ahead (`Populate`):
- "start": when the mapping is made (MAP_POPULATE, Linux): its time grows with the pool's
  size, all of it on the start-up path;
- "background": by a thread, after the mapping is made, while the engine finishes
  loading and the server starts (madvise MADV_POPULATE_WRITE, Linux 5.14+: it fills the
  page tables as writes would, without writing, so K/V a request writes meanwhile is never
  touched; the call runs in the kernel with the GIL released). Where the kernel lacks it,
  "start" instead.
Either way the pool's memory is resident from the first seconds instead of growing into it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import threading

import torch

from prelude.config import Populate

logger = logging.getLogger("prelude.model.attention.kv_memory")

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+
POPULATE_PIECE_BYTES = 8 << 20  # page-aligned


def zeroed_kv_tensors(
    count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, populate: Populate = "off"
) -> list[torch.Tensor]:
    """`count` zero tensors of `shape`; on the CPU views of one mapping whose pages are
    faulted in as `populate` says (where the OS can), else at their first write."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    numel = math.prod(shape)
    if numel == 0 or count == 0:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    background = populate == "background" and populate_write_works()
    now = populate == "start" or (populate == "background" and not background)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if now else 0)
    region = mmap.mmap(-1, count * numel * dtype.itemsize, flags=flags)  # zero-filled by the kernel
    # frombuffer keeps `region` alive as long as any view of it lives.
    flat = torch.frombuffer(region, dtype=dtype)
    if background:
        populate_in_background(flat)
    return [flat[i * numel : (i + 1) * numel].view(shape) for i in range(count)]


def populate_in_background(flat: torch.Tensor) -> threading.Thread:
    """Fault in the pages under `flat` (a contiguous CPU tensor over a private anonymous
    mapping, page-aligned) from a daemon thread; the thread, started. The tensor is held
    until it is done, so the mapping outlives the call."""

    def run() -> None:
        start, length = flat.data_ptr(), flat.numel() * flat.element_size()
        # A piece at a time: the call holds the process's memory-map lock, which every mmap,
        # brk and page fault of the loading thread waits for (1 GiB in one call held up the
        # rest of start-up for as long as it ran)
        for offset in range(0, length, POPULATE_PIECE_BYTES):
            if not _populate_write(start + offset, min(POPULATE_PIECE_BYTES, length - offset)):
                logger.debug("MADV_POPULATE_WRITE failed (errno %d): the KV pool faults its pages in as written",
                             ctypes.get_errno())
                return

    thread = threading.Thread(target=run, name="prelude-kv-pages", daemon=True)
    thread.start()
    return thread


def _populate_write(address: int, length: int) -> bool:
    libc = _libc()
    return libc is not None and libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length),
                                             MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):  # no C library symbols (not a POSIX system)
        return None


@functools.cache
def populate_write_works() -> bool:
    """Whether this kernel takes MADV_POPULATE_WRITE (tried once, on a page of its own)."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        return _populate_write(ctypes.addressof(ctypes.c_char.from_buffer(page)), mmap.PAGESIZE)
    finally:
        page.close()
