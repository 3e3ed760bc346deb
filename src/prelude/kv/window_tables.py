"""The block tables of sliding-window layers: a second pool whose blocks hold only what a
window still sees.

A sliding layer's query at position p reads the keys at p - window + 1 .. p only, so a
request's window table keeps the blocks from its next query's window on, and releases each
block once the request's next query is past it: at most window / block_size + 1 blocks a
request between steps (a prompt chunk adds its own blocks for its step). The table is
index-aligned with the request's table of the global layers (entry i holds positions
[i * block_size, (i + 1) * block_size)); released entries are RELEASED, and nothing reads
them (the attention kernels start at each row's first window).

Prefix cache: each cached block of the global layers' tree may have a *partner*, the
window pool's block holding the same tokens' K/V for the sliding layers. A hit of m blocks
needs the partners of the blocks its first new query's window reaches back into; a hit
whose partners were evicted is shortened to the longest prefix that has them (or missed).
Partners are cached blocks of the window pool with its own LRU: unreferenced ones are
evictable, and evicting one only forgets the pairing (the global block stays cached). A
global block dropped from the tree drops its partner.

OneShot rows hold blocks for one step: their prefix's partners (pinned) and a window block
beside each block they publish; after the step the published pairs join the cache.
"""

from __future__ import annotations

from prelude.kv.block_pool import BlockPool, NoFreeBlocksError

RELEASED = -1  # a window table's entry whose block went back to the pool


class WindowTables:
    def __init__(self, window: int, num_blocks: int, block_size: int) -> None:
        if window < 1:
            raise ValueError("a sliding window spans at least one token")
        self.window = window
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.pool.set_evictor(self.evict)
        self._tables: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}  # entries before this index are RELEASED (slide's start)
        self._partner: dict[int, int] = {}  # global layers' cached block -> its window block
        self._paired: dict[int, int] = {}  # window block -> the global block it partners
        # window blocks beside a OneShot step's publish blocks (global block -> window block)
        self._stepping: dict[int, int] = {}
        # a OneShot step's window entries, by (prefix blocks, publish blocks); a stack: rows
        # with equal keys pin equal entries
        self._steps: dict[tuple[tuple[int, ...], tuple[int, ...]], list[list[int]]] = {}

    @property
    def max_blocks_per_request(self) -> int:
        """What a request holds between steps: its next query's window, over block edges."""
        return (self.window - 1 + self.block_size - 1) // self.block_size + 1

    def first_needed(self, next_position: int) -> int:
        """The first entry a query at `next_position` (or later) reads."""
        return max(0, next_position - self.window + 1) // self.block_size

    # --- paged requests ---------------------------------------------------------------

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def grow(self, request_id: str, new_entries: int) -> None:
        """Append `new_entries` blocks (the pool has checked room for them)."""
        if new_entries:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(new_entries))

    def slide(self, request_id: str, next_position: int) -> int:
        """Release the entries before the window of the request's next query; how many."""
        table = self._tables.get(request_id)
        if not table:
            return 0
        start, end = self._released.get(request_id, 0), min(self.first_needed(next_position), len(table))
        if end <= start:
            return 0
        out = [b for b in table[start:end] if b != RELEASED]
        self.pool.release(out)
        table[start:end] = [RELEASED] * (end - start)
        self._released[request_id] = end
        return len(out)

    def attach(self, request_id: str, prefix: list[int]) -> None:
        """Start a request's table after a prefix hit: the partners of the prefix's blocks
        its first new query's window reaches (`usable_hit` checked they exist), pinned."""
        assert request_id not in self._tables
        start = self.first_needed(len(prefix) * self.block_size)
        table = [RELEASED] * start + [self._partner[b] for b in prefix[start:]]
        self.pool.acquire(b for b in table if b != RELEASED)
        self._tables[request_id] = table
        self._released[request_id] = start

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        self._released.pop(request_id, None)
        if table:
            self.pool.release(b for b in reversed(table) if b != RELEASED)

    def held(self) -> int:
        """Window blocks the requests' tables hold."""
        return sum(b != RELEASED for t in self._tables.values() for b in t)

    # --- prefix cache -----------------------------------------------------------------

    def usable_hit(self, blocks: list[int]) -> int:
        """How many of a hit's blocks (the global layers' cached chain) can be used: the
        longest prefix whose last window has every partner."""
        m = len(blocks)
        while m:
            start = self.first_needed(m * self.block_size)
            missing = [i for i in range(start, m) if blocks[i] not in self._partner]
            if not missing:
                return m
            m = missing[-1]  # a hit ending at or before the last missing block
        return 0

    def publish(self, nodes: list[int], entries: list[int]) -> int:
        """Pair the cached global blocks `nodes` (a chain from the tree's root) with the
        window blocks `entries` holding the same tokens (RELEASED: none); a node already
        paired keeps its partner. Returns how many pairs were made."""
        made = 0
        for node, b in zip(nodes, entries):
            if b == RELEASED or node in self._partner or self.pool.is_cached(b):
                continue
            self._partner[node] = b
            self._paired[b] = node
            self.pool.mark_cached(b)
            made += 1
        return made

    def drop(self, node: int) -> None:
        """The global block `node` left the prefix tree: its partner goes too."""
        b = self._partner.pop(node, None)
        if b is not None:
            del self._paired[b]
            self.pool.forget(b)

    def evict(self, n: int) -> int:
        """Free at least n unreferenced partners, LRU first (the pool's evictor)."""
        freed = 0
        while freed < n:
            b = self.pool.lru_evictable()
            if b is None:
                break
            del self._partner[self._paired.pop(b)]
            self.pool.evict(b)
            freed += 1
        return freed

    @property
    def num_partners(self) -> int:
        return len(self._partner)

    # --- OneShot steps ----------------------------------------------------------------

    def hold_step(self, prefix: list[int], publish: list[int]) -> list[int]:
        """Pin the partners of `prefix`'s last window and allocate a window block beside each
        of `publish`; the row's window entries (aligned with prefix + publish). Raises
        NoFreeBlocksError (nothing taken) where the pool has no room for them."""
        start = self.first_needed(len(prefix) * self.block_size)
        pinned = [self._partner.get(b, self._stepping.get(b, RELEASED)) for b in prefix[start:]]
        if RELEASED in pinned:
            raise ValueError("a OneShot prefix without the window blocks its hit needs (see usable_hit)")
        self.pool.acquire(pinned)
        if len(publish) > self.pool.num_available_blocks:
            self.pool.release(pinned)
            raise NoFreeBlocksError(f"asked for {len(publish)} window blocks, {self.pool.num_available_blocks} "
                                    "available")
        beside = self.pool.allocate(len(publish))
        self._stepping.update(zip(publish, beside))
        entries = [RELEASED] * start + pinned + beside
        self._steps.setdefault((tuple(prefix), tuple(publish)), []).append(entries)
        return entries

    def step_entries(self, prefix: list[int], publish: list[int]) -> list[int]:
        """The window entries `hold_step` gave the row holding (prefix, publish)."""
        return self._steps[(tuple(prefix), tuple(publish))][-1]

    def end_step(self, prefix: list[int], publish: list[int], nodes: list[int] | None) -> None:
        """The row's step is over: with `nodes` (the cached chain its prompt now has), its
        window blocks partner those nodes where they have none; its holds are dropped."""
        key = (tuple(prefix), tuple(publish))
        stack = self._steps[key]
        entries = stack.pop()
        if not stack:
            del self._steps[key]
        for b in publish:
            self._stepping.pop(b, None)
        if nodes is not None:
            self.publish(nodes, entries)
        self.pool.release(b for b in reversed(entries) if b != RELEASED)

    def check_integrity(self) -> None:
        """Between steps: every window block free, partnered, or held by the tables."""
        if self._steps or self._stepping:
            raise AssertionError("OneShot window holds outlived their step")
        if {v: k for k, v in self._partner.items()} != self._paired:
            raise AssertionError("window partners are inconsistent")
        for rid, table in self._tables.items():
            if any(b != RELEASED for b in table[: self._released.get(rid, 0)]):
                raise AssertionError(f"request {rid}: a window entry held before its released ones")
        self.pool.check_integrity([[b for b in t if b != RELEASED] for t in self._tables.values()],
                                  set(self._paired))
