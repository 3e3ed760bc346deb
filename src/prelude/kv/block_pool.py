"""Paged KV blocks: a free list, reference counts, and an LRU of cached blocks.

A block is in exactly one of three states:
- free: ref count 0, on the free list;
- held: ref count = number of holders (requests, or a OneShot batch for one step);
- cached: registered by the prefix cache. A cached block nobody holds (ref 0) is
  *evictable*: it stays hit-able until the pool needs room, LRU first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Iterable


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: set[int] = set()
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, LRU first
        # Set by the prefix cache: frees at least n evictable blocks, returns how many.
        self._evict: Callable[[int], int] | None = None

    def set_evictor(self, evict: Callable[[int], int]) -> None:
        self._evict = evict

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_available_blocks} available")
        if n > len(self._free) and self._evict is not None:
            self._evict(n - len(self._free))
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def acquire(self, blocks: Iterable[int]) -> None:
        """Add a holder to blocks that are already held or cached (prefix hits)."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                if b not in self._evictable:
                    raise RuntimeError(f"block {b} is free; only held or cached blocks can be shared")
                del self._evictable[b]
            self._ref_counts[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block. Unreferenced cached blocks become evictable
        (most recently released last), others return to the free list."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} released more often than held")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if b in self._cached:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # --- used by the prefix cache -------------------------------------------------------

    def mark_cached(self, block: int) -> None:
        self._cached.add(block)
        if self._ref_counts[block] == 0:
            self._evictable[block] = None

    def evict(self, block: int) -> None:
        """Forget a cached, unreferenced block: it becomes free."""
        if self._ref_counts[block] != 0:
            raise RuntimeError(f"block {block} is in use and can not be evicted")
        self._cached.discard(block)
        self._evictable.pop(block, None)
        self._free.append(block)

    def forget(self, block: int) -> None:
        """Drop a block's cached state: it is free now if nobody holds it, else when its
        last holder releases it."""
        if self._ref_counts[block] == 0:
            self.evict(block)
        else:
            self._cached.discard(block)

    def lru_evictable(self) -> int | None:
        return next(iter(self._evictable), None)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_integrity(self, holders: Iterable[Iterable[int]], cached: set[int] | None = None) -> None:
        """Every block is free, cached, or held exactly as often as the holders list it."""
        expected = [0] * self.num_blocks
        for table in holders:
            for b in table:
                expected[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if cached is not None and cached != self._cached:
            raise AssertionError(f"pool and prefix cache disagree on cached blocks: {cached ^ self._cached}")
        for b in range(self.num_blocks):
            if self._ref_counts[b] != expected[b]:
                raise AssertionError(f"block {b}: ref count {self._ref_counts[b]}, held {expected[b]} times")
            is_free, is_cached = b in free, b in self._cached
            if is_free and (is_cached or expected[b]):
                raise AssertionError(f"block {b} is free but cached={is_cached} held={expected[b]}")
            if not is_free and not is_cached and expected[b] == 0:
                raise AssertionError(f"block {b} leaked: not free, not cached, not held")
            if (b in self._evictable) != (is_cached and expected[b] == 0):
                raise AssertionError(f"block {b}: evictable state is wrong")
