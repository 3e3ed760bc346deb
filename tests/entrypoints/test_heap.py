"""The start-up heap freeze (entrypoints/heap.py): garbage made before it is still
collected, what is alive then is frozen, and cycles made after it stay collectable."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from prelude.entrypoints.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()  # the rest of the test process collects as before


def test_garbage_before_the_freeze_is_collected_and_the_living_heap_frozen(unfrozen: None) -> None:
    dead, alive = _Node(), _Node()
    gone = weakref.ref(dead)
    del dead
    frozen = freeze_startup_heap()
    assert gone() is None  # collected first, not frozen for the process's life
    assert frozen == gc.get_freeze_count() > 0
    assert not any(obj is alive for obj in gc.get_objects())  # moved out of the generations a pass walks
    later = _Node()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None  # cycles made while serving are still freed
