"""Paged KV blocks: a free list and reference counts.

A block is either free (ref count 0, on the free list) or held by one or more owners
(ref count = number of holders). The prefix cache will add a third state, cached.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks nobody holds return to the free list."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} released more often than held")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_integrity(self, holders: Iterable[Iterable[int]]) -> None:
        """Every block is free, or held exactly as often as the holders' tables list it."""
        expected = [0] * self.num_blocks
        for table in holders:
            for b in table:
                expected[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b in range(self.num_blocks):
            if self._ref_counts[b] != expected[b]:
                raise AssertionError(f"block {b}: ref count {self._ref_counts[b]}, held {expected[b]} times")
            if (b in free) != (expected[b] == 0):
                raise AssertionError(f"block {b}: free={b in free} but held {expected[b]} times")
