"""Block tables of running requests on top of the block pool, with prefix reuse."""

from __future__ import annotations

from dataclasses import dataclass

from prelude.kv.block_pool import BlockPool, NoFreeBlocksError
from prelude.kv.prefix_cache import PrefixCache
from prelude.kv.state_slots import StateSlots
from prelude.kv.window_tables import WindowTables


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


@dataclass
class PrefixStats:
    """How much prompt work the prefix cache saved."""

    queries: int = 0
    hits: int = 0  # queries that reused at least one block
    reused_tokens: int = 0  # prompt tokens attached from the cache
    computed_tokens: int = 0  # prompt tokens computed (the rest of each prompt)
    published_blocks: int = 0
    deferred: int = 0  # requests that waited a step for a leader to fill their prefix
    riders: int = 0  # OneShot requests that read a leader's prefix blocks in the leader's own step

    @property
    def hit_rate(self) -> float:
        total = self.reused_tokens + self.computed_tokens
        return self.reused_tokens / total if total else 0.0


class KVCacheManager:
    """Owns the per-request block tables (and, for models with recurrent layers, each
    request's state slot; for models with sliding-window layers beside global ones, each
    request's window table: kv/window_tables.py); the scheduler asks it for room and prefixes."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
        max_cached_blocks: int | None = None, num_state_slots: int = 0, window: int = 0,
        num_window_blocks: int = 0,
    ) -> None:
        """`window` (> 0): the sliding layers' span, whose K/V live in a pool of their own of
        `num_window_blocks` blocks; `pool` is then the global layers'."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix: PrefixCache | None = (
            PrefixCache(self.pool, block_size, max_cached_blocks) if enable_prefix_caching else None
        )
        self.stats = PrefixStats()
        self._tables: dict[str, list[int]] = {}
        # Recurrent-state slots (0: the model has no recurrent layers): a request takes one
        # with its first allocation and gives it back with its blocks.
        self.slots: StateSlots | None = StateSlots(num_state_slots) if num_state_slots else None
        self._slots: dict[str, int] = {}
        self.windows: WindowTables | None = (
            WindowTables(window, num_window_blocks, block_size) if window else None)
        if self.windows is not None and self.prefix is not None:
            self.prefix.on_drop = self.windows.drop

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_available_blocks(self) -> int:
        return self.pool.num_available_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def window_table(self, request_id: str) -> list[int] | None:
        """The request's sliding layers' table (RELEASED before its window); None: the model
        has no window pool."""
        return None if self.windows is None else self.windows.table(request_id)

    def advance(self, request_id: str, num_computed: int) -> None:
        """The request's first `num_computed` tokens are computed: its window table lets go
        of the blocks its next query's window has passed."""
        if self.windows is not None:
            self.windows.slide(request_id, num_computed)

    def state_slot(self, request_id: str) -> int | None:
        """The request's state slot (None: the model keeps no recurrent state)."""
        return self._slots.get(request_id)

    @property
    def num_free_slots(self) -> int | None:
        return None if self.slots is None else self.slots.num_free_slots

    # --- prefixes ---------------------------------------------------------------------

    def match(self, tokens: list[int], namespace: str = "") -> list[int]:
        """Cached blocks of the longest prefix, always leaving the last token to compute
        (its logits are the point of the forward). Pins nothing. `namespace`: the
        adapter's (see PrefixCache)."""
        if self.prefix is None:
            return []
        blocks = self.prefix.match(tokens, (len(tokens) - 1) // self.block_size, namespace)
        # the sliding layers need the hit's last window: without it the hit is shorter
        return blocks if self.windows is None else blocks[: self.windows.usable_hit(blocks)]

    def match_partial(self, tokens: list[int], matched: list[int], namespace: str = "") -> tuple[int, int] | None:
        """A hit continuing the full blocks `matched` inside the next block: (the cached
        block holding those tokens, how many), leaving the last token to compute; None
        without one (see PrefixCache.partial)."""
        if self.prefix is None or self.windows is not None:  # no partial copies of window blocks
            return None
        return self.prefix.partial(tokens, matched, len(tokens) - 1 - len(matched) * self.block_size, namespace)

    def first_uncached_key(self, tokens: list[int], num_matched_blocks: int,
                           namespace: str = "") -> tuple[object, ...] | None:
        """Identity of the first full block a request would compute and publish: requests
        with the same key share a cold prefix (see the scheduler's leader deferral)."""
        end = (num_matched_blocks + 1) * self.block_size
        if self.prefix is None or end > len(tokens) - 1:
            return None
        return (namespace, *tokens[:end])

    def record(self, reused: int, computed: int) -> None:
        self.stats.queries += 1
        self.stats.hits += reused > 0
        self.stats.reused_tokens += reused
        self.stats.computed_tokens += computed

    def attach(self, request_id: str, blocks: list[int]) -> None:
        """Start a request's table with shared cached blocks (pinned while it holds them)."""
        assert request_id not in self._tables
        self.pool.acquire(blocks)
        self._tables[request_id] = list(blocks)
        if self.windows is not None:
            self.windows.attach(request_id, blocks)

    def cache_computed(self, request_id: str, tokens: list[int], num_computed: int, namespace: str = "") -> None:
        """Publish the request's full blocks whose K/V are computed."""
        if self.prefix is None:
            return
        table = self._tables.get(request_id, [])
        full = min(num_computed // self.block_size, len(table))
        if full:
            self.prefix.insert(tokens, table[:full], namespace)
            if self.windows is not None:
                nodes = self.prefix.match(tokens, full, namespace)
                self.windows.publish(nodes, self.windows.table(request_id)[: len(nodes)])

    # --- OneShot: blocks held for one step only --------------------------------------

    def hold_for_step(self, prefix_blocks: list[int], publish: int,
                      copy_from: int | None = None) -> tuple[list[int], int | None]:
        """Pin a OneShot row's prefix (and `copy_from`, the cached block its hit ends
        inside) and allocate `publish` blocks to write its own full prompt blocks into.
        Returns (the publish blocks, copy_from): none and None where the pool has no room
        for them (the first publish block is where copy_from's slots are copied)."""
        self.pool.acquire(_with_copy_source(prefix_blocks, copy_from))
        # Checked after pinning: pinned prefix blocks that were evictable are no longer
        # available, so checking before could promise blocks the pool no longer has.
        if publish and publish > self.pool.num_available_blocks:
            publish = 0
        if copy_from is not None and not publish:
            self.pool.release([copy_from])
            copy_from = None
        blocks = self.pool.allocate(publish) if publish else []
        if self.windows is not None:
            try:
                self.windows.hold_step(prefix_blocks, blocks)
            except NoFreeBlocksError:  # no window blocks to publish beside: publish nothing
                self.pool.release(reversed(blocks))
                blocks = []
                self.windows.hold_step(prefix_blocks, blocks)
        return blocks, copy_from

    def step_window(self, prefix_blocks: list[int], publish_blocks: list[int]) -> list[int] | None:
        """A OneShot row's window entries (aligned with prefix + publish blocks), as its
        `hold_for_step` took them; None: the model has no window pool."""
        return None if self.windows is None else self.windows.step_entries(prefix_blocks, publish_blocks)

    def end_step(self, tokens: list[int], prefix_blocks: list[int], publish_blocks: list[int],
                 namespace: str = "", copy_from: int | None = None) -> None:
        """After the forward: published blocks join the cache (owned by it, evictable),
        then the step's holds are dropped. Nothing stays counted as the request's."""
        if self.prefix is not None and publish_blocks:
            chain = prefix_blocks + publish_blocks
            cached = self.prefix.insert(tokens, chain, namespace)
            self.stats.published_blocks += max(0, cached - len(prefix_blocks))
        if self.windows is not None:
            nodes = (self.prefix.match(tokens, len(prefix_blocks) + len(publish_blocks), namespace)
                     if self.prefix is not None and publish_blocks else None)
            self.windows.end_step(prefix_blocks, publish_blocks, nodes)
        self.pool.release(reversed(_with_copy_source(prefix_blocks + publish_blocks, copy_from)))

    def drop_step(self, prefix_blocks: list[int], publish_blocks: list[int], copy_from: int | None = None) -> None:
        """The forward failed: drop the step's holds and publish nothing (the blocks it
        was writing may hold partial KV)."""
        if self.windows is not None:
            self.windows.end_step(prefix_blocks, publish_blocks, None)
        self.pool.release(reversed(_with_copy_source(prefix_blocks + publish_blocks, copy_from)))

    # --- paged requests ---------------------------------------------------------------

    def num_new_blocks(self, request_id: str, total_tokens: int) -> int:
        """Blocks to add so that `total_tokens` tokens of the request have slots."""
        return max(0, blocks_needed(total_tokens, self.block_size) - len(self.block_table(request_id)))

    def allocate(self, request_id: str, total_tokens: int, reserve: int = 0) -> bool:
        """Grow the request's table to cover `total_tokens`; False (and no change) if the
        pool would drop below `reserve` available blocks."""
        need = self.num_new_blocks(request_id, total_tokens)
        if need > self.pool.num_available_blocks - reserve:
            return False
        if self.windows is not None and need > self.windows.pool.num_available_blocks:
            return False
        if self.slots is not None and request_id not in self._slots:
            if not self.slots.num_free_slots:
                return False
            self._slots[request_id] = self.slots.allocate()
        if need:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(need))
            if self.windows is not None:
                self.windows.grow(request_id, need)
        return True

    def free(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None and self.slots is not None:
            self.slots.release(slot)
        table = self._tables.pop(request_id, None)
        if table:
            # Tail first: the prefix's deepest blocks become the first eviction candidates.
            self.pool.release(reversed(table))
        if self.windows is not None:
            self.windows.free(request_id)

    def trim(self) -> None:
        if self.prefix is not None:
            self.prefix.trim()

    def holders(self) -> dict[str, list[int]]:
        """Requests holding blocks or a state slot, and their blocks."""
        return {**{rid: [] for rid in self._slots}, **self._tables}

    def check_integrity(self) -> None:
        cached = None
        if self.prefix is not None:
            self.prefix.check_integrity()
            cached = self.prefix.cached_blocks()
        self.pool.check_integrity(self._tables.values(), cached)
        if self.slots is not None:
            self.slots.check_integrity(self._slots.values())
        elif self._slots:
            raise AssertionError("state slots held without a state pool")
        if self.windows is not None:
            self.windows.check_integrity()
            for rid, table in self._tables.items():
                if len(self.windows.table(rid)) != len(table):
                    raise AssertionError(f"request {rid}: window table and block table differ in length")


def _with_copy_source(blocks: list[int], copy_from: int | None) -> list[int]:
    """A OneShot step's held blocks: `blocks`, and the cached block its hit ends inside."""
    return blocks if copy_from is None else [*blocks, copy_from]
