"""A long-running process's heaps: the cyclic garbage collector paused while start-up
builds (collection_paused_for_startup), the start-up objects kept out of its full passes
(freeze_startup_heap), and the C heap's free pages handed back during a long job
(NativeHeapTrim).

A served process holds a few hundred thousand Python objects from start-up (the model's
modules, the tokenizer, FastAPI's routes, pydantic's schemas) that never become garbage.
CPython's full (generation 2) collection walks all of them, every few seconds of load,
with the GIL held, so the event loop and the engine thread both stop for a pass far longer
than a small model's request. Freezing the start-up heap (gc.freeze: the objects move
to a permanent generation the collector never walks) leaves a full pass only the
objects made since.

Before that, while start-up imports torch, FastAPI and the routes, the collector runs its
passes over that same growing heap, none of which finds much, and start-up is slower for
them. So start-up pauses it, and freeze_startup_heap, once everything is loaded, collects
once, freezes and resumes it. That one collection still walks the whole heap with the GIL
held; freeze_imports, called once the modules are imported, freezes them without a pass,
so the collection at ready walks only what loading built since. The price: what the
imports left unreachable (a few thousand objects, under a megabyte) is frozen with them
for the life of the process.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused_for_startup() -> Iterator[None]:
    """The cyclic collector off from here until freeze_startup_heap resumes it; leaving the
    block resumes it too, so a start-up that fails (or a caller that never serves, like a
    test) does not leave the process without it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_imports() -> None:
    """Freeze every object alive now, garbage included, without a collection (see above):
    for start-up, once the modules are imported and before the model is built."""
    gc.freeze()


def freeze_startup_heap() -> int:
    """Collect what start-up left unreachable, then freeze every object alive now and
    resume the collector (paused by collection_paused_for_startup, if it was); returns how
    many objects are frozen. Call once, when the process is ready to serve."""
    gc.collect()
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()


class NativeHeapTrim:
    """Hands the C heap's free pages back to the system at most every `every_s` seconds
    (glibc's malloc_trim; a no-op elsewhere). A long job's torch/oneDNN temporaries come
    and go in glibc's per-thread arenas, whose freed pages stay resident: a long embeddings
    job's RSS steps up that way and never comes back down."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._last = time.monotonic()
        self.trims = 0
        try:
            self._trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):  # not glibc
            self._trim = None

    def maybe(self) -> bool:
        """Trim if `every_s` has passed since the last one; whether it trimmed."""
        now = time.monotonic()
        if self._trim is None or now - self._last < self.every_s:
            return False
        self._last = now
        self._trim(0)
        self.trims += 1
        return True
