"""Block tables of running requests on top of the block pool, with prefix reuse."""

from __future__ import annotations

from dataclasses import dataclass

from prelude.kv.block_pool import BlockPool
from prelude.kv.prefix_cache import CheckpointHit, PrefixCache
from prelude.kv.state_checkpoints import StateCheckpoints
from prelude.kv.state_slots import StateSlots


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
    checkpoints_saved: int = 0  # recurrent state checkpoints attached to the prefix tree

    @property
    def hit_rate(self) -> float:
        total = self.reused_tokens + self.computed_tokens
        return self.reused_tokens / total if total else 0.0


class KVCacheManager:
    """Owns the per-request block tables (and, for models with recurrent layers, each
    request's state slot); the scheduler asks it for room and prefixes."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
        max_cached_blocks: int | None = None, num_state_slots: int = 0, num_checkpoint_slots: int = 0,
        checkpoint_stride: int = 512,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # Models with recurrent layers reuse a prefix only with its state at the prefix's
        # end: checkpoint slots after the running slots of the same state tensors, saved
        # every `checkpoint_stride` tokens (a multiple of the block size) and where peers'
        # prompts part (see the scheduler); none: such a model caches no prefixes.
        self.checkpoints: StateCheckpoints | None = None
        if num_state_slots and enable_prefix_caching and num_checkpoint_slots:
            self.checkpoints = StateCheckpoints(num_checkpoint_slots, first_slot=num_state_slots)
        if self.checkpoints is not None and (checkpoint_stride < block_size or checkpoint_stride % block_size):
            raise ValueError(f"the state checkpoint stride ({checkpoint_stride}) must be a multiple of the block "
                             f"size ({block_size})")
        self.checkpoint_stride = checkpoint_stride
        self.prefix: PrefixCache | None = (
            PrefixCache(self.pool, block_size, max_cached_blocks, self.checkpoints)
            if enable_prefix_caching and (not num_state_slots or self.checkpoints is not None) else None
        )
        self.stats = PrefixStats()
        self._tables: dict[str, list[int]] = {}
        # Recurrent-state slots (0: the model has no recurrent layers): a request takes one
        # with its first allocation and gives it back with its blocks.
        self.slots: StateSlots | None = StateSlots(num_state_slots) if num_state_slots else None
        self._slots: dict[str, int] = {}
        # A paged request that hit a checkpointed prefix: the checkpoint its first row
        # restores (pinned until that row's step ends)
        self._restores: dict[str, int] = {}
        self._copies: dict[str, int] = {}  # and the block holding its hit's last tokens (see attach)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_available_blocks(self) -> int:
        return self.pool.num_available_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

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
        adapter's (see PrefixCache). With recurrent layers: the longest that ends at a
        block boundary with a checkpoint (`state_hit` says which)."""
        if self.prefix is None:
            return []
        if self.checkpoints is not None:
            hit, _ = self.prefix.checkpoint_hit(tokens, len(tokens) - 1, namespace, inside_blocks=False)
            return hit.blocks if hit is not None else []
        return self.prefix.match(tokens, (len(tokens) - 1) // self.block_size, namespace)

    def state_hit(self, tokens: list[int], namespace: str = "", inside_blocks: bool = False,
                  limit: int | None = None) -> tuple[CheckpointHit | None, int]:
        """Models with recurrent layers: the longest cached prefix ending at a checkpoint,
        leaving the last token (or past `limit`) to compute, and how far the cached K/V
        agree with `tokens` (see PrefixCache.checkpoint_hit). Pins nothing."""
        if self.prefix is None or self.checkpoints is None:
            return None, 0
        return self.prefix.checkpoint_hit(tokens, len(tokens) - 1 if limit is None else limit, namespace,
                                          inside_blocks)

    def hold_checkpoint(self, slot: int) -> None:
        assert self.checkpoints is not None
        self.checkpoints.hold(slot)

    def release_checkpoint(self, slot: int) -> None:
        assert self.checkpoints is not None
        self.checkpoints.release(slot)

    def checkpoint_positions(self, start: int, end: int, extra: tuple[int, ...] = ()) -> list[int]:
        """Where a row computing tokens [start, end) keeps checkpoints: the stride's
        positions in (start, end], and `extra` ones there (peers part there), in order."""
        if self.checkpoints is None or end <= start:
            return []
        stride = self.checkpoint_stride
        found = set(range((start // stride + 1) * stride, end + 1, stride))
        found.update(p for p in extra if start < p <= end)
        return sorted(found)

    def save_slots(self, positions: list[int]) -> tuple[tuple[int, int], ...]:
        """Pending checkpoint slots for the states at `positions` (position, slot); fewer
        (the first ones) when every slot is pinned."""
        if self.checkpoints is None:
            return ()
        saves = []
        for p in positions:
            slot = self.checkpoints.allocate()
            if slot is None:
                break
            saves.append((p, slot))
        return tuple(saves)

    def end_saves(self, tokens: list[int], saves: tuple[tuple[int, int], ...], ok: bool,
                  namespace: str = "") -> None:
        """After a step that wrote `saves`: each becomes the checkpoint of its prefix's node
        (on success, where that node is cached and has none there yet), or is freed."""
        for position, slot in saves:
            assert self.checkpoints is not None and self.prefix is not None
            if ok and self.prefix.attach_checkpoint(tokens, position, slot, namespace):
                self.stats.checkpoints_saved += 1
            else:
                self.checkpoints.release(slot)

    def match_partial(self, tokens: list[int], matched: list[int], namespace: str = "") -> tuple[int, int] | None:
        """A hit continuing the full blocks `matched` inside the next block: (the cached
        block holding those tokens, how many), leaving the last token to compute; None
        without one (see PrefixCache.partial)."""
        if self.prefix is None:
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

    def attach(self, request_id: str, blocks: list[int], restore: int | None = None,
               copy_from: int | None = None) -> None:
        """Start a request's table with shared cached blocks (pinned while it holds them);
        `restore`: the checkpoint of the state at their end (models with recurrent layers),
        pinned until the request's first row has read it (`restored`); `copy_from`: a hit
        ending inside the next block, the cached block whose first slots that row copies
        into the request's own copy of it (its next allocated block), pinned as long."""
        assert request_id not in self._tables
        self.pool.acquire(blocks)
        self._tables[request_id] = list(blocks)
        if restore is not None:
            self.hold_checkpoint(restore)
            self._restores[request_id] = restore
        if copy_from is not None:
            self.pool.acquire([copy_from])
            self._copies[request_id] = copy_from

    def copy_source(self, request_id: str) -> int | None:
        """The cached block the request's next row copies its hit's last slots from."""
        return self._copies.get(request_id)

    def restore_slot(self, request_id: str) -> int | None:
        """The checkpoint the request's next row starts from (None: its own slot or zeros)."""
        return self._restores.get(request_id)

    def restored(self, request_id: str) -> None:
        """The request's first row ran: its state is in its own slot now."""
        slot = self._restores.pop(request_id, None)
        if slot is not None:
            self.release_checkpoint(slot)
        block = self._copies.pop(request_id, None)
        if block is not None:
            self.pool.release([block])

    def cache_computed(self, request_id: str, tokens: list[int], num_computed: int, namespace: str = "") -> None:
        """Publish the request's full blocks whose K/V are computed."""
        if self.prefix is None:
            return
        table = self._tables.get(request_id, [])
        full = min(num_computed // self.block_size, len(table))
        if full:
            self.prefix.insert(tokens, table[:full], namespace)

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
        return (self.pool.allocate(publish) if publish else []), copy_from

    def end_step(self, tokens: list[int], prefix_blocks: list[int], publish_blocks: list[int],
                 namespace: str = "", copy_from: int | None = None) -> None:
        """After the forward: published blocks join the cache (owned by it, evictable),
        then the step's holds are dropped. Nothing stays counted as the request's."""
        if self.prefix is not None and publish_blocks:
            chain = prefix_blocks + publish_blocks
            cached = self.prefix.insert(tokens, chain, namespace)
            self.stats.published_blocks += max(0, cached - len(prefix_blocks))
        self.drop_step(prefix_blocks, publish_blocks, copy_from)

    def drop_step(self, prefix_blocks: list[int], publish_blocks: list[int], copy_from: int | None = None) -> None:
        """The forward failed: drop the step's holds and publish nothing (the blocks it
        was writing may hold partial KV)."""
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
        if self.slots is not None and request_id not in self._slots:
            if not self.slots.num_free_slots:
                return False
            self._slots[request_id] = self.slots.allocate()
        if need:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(need))
        return True

    def free(self, request_id: str) -> None:
        self.restored(request_id)
        slot = self._slots.pop(request_id, None)
        if slot is not None and self.slots is not None:
            self.slots.release(slot)
        table = self._tables.pop(request_id, None)
        if table:
            # Tail first: the prefix's deepest blocks become the first eviction candidates.
            self.pool.release(reversed(table))

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
        self.pool.check_integrity([*self._tables.values(), self._copies.values()], cached)
        if self.slots is not None:
            self.slots.check_integrity(self._slots.values())
        elif self._slots:
            raise AssertionError("state slots held without a state pool")
        if self.checkpoints is not None and self.prefix is not None:
            self.checkpoints.check_integrity(self._restores.values(), self.prefix.attached_checkpoints())
        elif self._restores:
            raise AssertionError("checkpoints restored without a checkpoint pool")


def _with_copy_source(blocks: list[int], copy_from: int | None) -> list[int]:
    """A OneShot step's held blocks: `blocks`, and the cached block its hit ends inside."""
    return blocks if copy_from is None else [*blocks, copy_from]
