"""Block pool + radix prefix cache bookkeeping."""

from __future__ import annotations

import gc
import random

import pytest

from prelude.kv.block_pool import BlockPool
from prelude.kv.kv_manager import KVCacheManager
from prelude.kv.prefix_cache import PrefixCache


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_match_insert_pin_and_release() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    prompt = tokens(10)
    assert kv.match(prompt) == []
    assert kv.allocate("a", 10)
    kv.cache_computed("a", prompt, 10)  # two full blocks
    a_table = kv.block_table("a")
    assert kv.match(prompt) == a_table[:2]
    assert kv.match(tokens(8)) == a_table[:1]  # the last token always stays to compute
    assert kv.match(tokens(9)) == a_table[:2]
    assert kv.match([99] + tokens(9, 1)) == []
    kv.attach("b", kv.match(prompt))  # b shares a's first two blocks
    assert kv.pool.ref_count(a_table[0]) == 2
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    assert kv.pool.num_evictable_blocks == 2 and kv.num_available_blocks == 16
    assert kv.match(prompt) == a_table[:2]  # still hit-able after everyone let go


def test_eviction_is_lru_and_never_touches_pinned_blocks() -> None:
    kv = KVCacheManager(6, 2, enable_prefix_caching=True)
    for i, start in enumerate((0, 100)):
        rid = f"r{i}"
        assert kv.allocate(rid, 4)
        kv.cache_computed(rid, tokens(4, start), 4)
        kv.free(rid)
    old, new = kv.match(tokens(5, 0)), kv.match(tokens(5, 100))
    assert len(old) == len(new) == 2
    kv.attach("pin", new)  # the newer prefix is in use
    assert kv.allocate("big", 6)  # needs 3 blocks: 2 free + 1 evicted
    assert kv.match(tokens(5, 100)) == new
    assert kv.match(tokens(5, 0)) == old[:1]  # the older prefix lost its tail block first
    assert not kv.allocate("more", 4)  # only 1 evictable block left
    kv.check_integrity()
    for rid in ("pin", "big"):
        kv.free(rid)
    kv.check_integrity()


def test_duplicate_blocks_stay_with_their_holder() -> None:
    kv = KVCacheManager(8, 2, enable_prefix_caching=True)
    for rid in ("a", "b"):  # both computed the same prompt before either was cached
        assert kv.allocate(rid, 4)
    kv.cache_computed("a", tokens(4), 4)
    kv.cache_computed("b", tokens(4), 4)
    kv.check_integrity()
    kv.free("b")  # b's copies were never cached: they go straight back to the free list
    assert kv.pool.num_free_blocks == 6
    kv.free("a")
    kv.check_integrity()


def test_oneshot_holds_publish_and_release() -> None:
    kv = KVCacheManager(8, 2, enable_prefix_caching=True)
    prompt = tokens(7)
    held, copy_from = kv.hold_for_step([], 3)
    assert len(held) == 3 and copy_from is None
    kv.end_step(prompt, [], held)
    assert kv.stats.published_blocks == 3
    assert kv.pool.num_evictable_blocks == 3 and kv.holders() == {}
    hit = kv.match(prompt)
    assert hit == held
    again, _ = kv.hold_for_step(hit, 0)
    assert again == [] and kv.pool.ref_count(hit[0]) == 1
    kv.end_step(prompt, hit, [])
    kv.check_integrity()


def test_budget_trims_unreferenced_cache() -> None:
    kv = KVCacheManager(16, 2, enable_prefix_caching=True, max_cached_blocks=2)
    assert kv.allocate("a", 8)
    kv.cache_computed("a", tokens(8), 8)
    kv.free("a")
    kv.trim()
    assert kv.pool.num_evictable_blocks == 2
    assert len(kv.match(tokens(9))) == 2  # the root-side blocks survive, leaves went first
    kv.check_integrity()


def test_integrity_check_catches_a_leak() -> None:
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    kv.pool.allocate(1)  # nobody records holding it
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_oneshot_hold_counts_pinned_prefix_blocks_as_taken() -> None:
    """Pinning an evictable prefix takes it out of the available blocks: the publish
    budget is checked after the pin (found by the soak: NoFreeBlocksError mid-schedule)."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    prompt = tokens(24)
    assert kv.allocate("a", 24)
    kv.cache_computed("a", prompt, 24)
    kv.free("a")  # six cached, evictable blocks; 8 available in all
    prefix = kv.match(prompt + [1])
    assert len(prefix) == 6 and kv.num_available_blocks == 8
    held, _ = kv.hold_for_step(prefix, publish=3)  # 3 <= 8 before the pin, but only 2 after it
    assert held == []  # nothing published this time, and nothing raised
    kv.end_step(prompt + [1], prefix, held)
    kv.check_integrity()
    assert kv.num_available_blocks == 8


def test_a_hit_goes_on_inside_the_next_block_and_its_copy_source_is_held_for_the_step() -> None:
    """Two prompts agreeing on 1.5 blocks: the second's full-block hit is 1 block, and the
    cached block that holds the next 2 tokens is found (never the prompt's last token)."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    held, _ = kv.hold_for_step([], 2)
    kv.end_step(first, [], held)  # blocks [1..4], [5..8] cached
    second = [1, 2, 3, 4, 5, 6, 70, 80, 90, 100]
    prefix = kv.match(second)
    assert prefix == held[:1]
    assert kv.match_partial(second, prefix) == (held[1], 2)
    assert kv.match_partial([1, 2, 3, 4, 5], kv.match([1, 2, 3, 4, 5])) is None  # only the last token is left
    assert kv.match_partial([1, 2, 3, 4, 5, 6], kv.match([1, 2, 3, 4, 5, 6])) == (held[1], 1)
    assert kv.match_partial([9, 9, 9, 9, 9], []) is None
    mine, copy_from = kv.hold_for_step(prefix, 1, held[1])
    assert copy_from == held[1] and len(mine) == 1 and kv.pool.ref_count(held[1]) == 1
    kv.end_step(second, prefix, mine, copy_from=copy_from)
    assert kv.pool.ref_count(held[1]) == 0 and kv.holders() == {}
    assert kv.match(second) == prefix + mine  # this row's copy of the block is cached in its own right
    kv.check_integrity()


def test_a_partial_hit_without_room_for_its_copy_is_dropped_and_unpinned() -> None:
    kv = KVCacheManager(3, 4, enable_prefix_caching=True)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    held, _ = kv.hold_for_step([], 2)
    kv.end_step(first, [], held)
    assert kv.allocate("other", 4)  # the one block left is taken
    second = [1, 2, 3, 4, 5, 6, 70, 80, 90]
    prefix = kv.match(second)
    mine, copy_from = kv.hold_for_step(prefix, 1, held[1])  # held[1] is pinned: nothing left to publish into
    assert mine == [] and copy_from is None and kv.pool.ref_count(held[1]) == 0
    kv.end_step(second, prefix, mine)
    kv.free("other")
    kv.check_integrity()


def _tracked_reachable(root: object, stop: object) -> int:
    """Objects the cyclic collector tracks among those reachable from `root` (not through
    `stop` or a class): what one of its full passes walks for them."""
    seen, stack, count = {id(root)}, [root], 0
    while stack:
        obj = stack.pop()
        count += gc.is_tracked(obj)
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and ref is not stop and not isinstance(ref, type):
                seen.add(id(ref))
                stack.append(ref)
    return count


def test_cached_blocks_add_nothing_for_the_garbage_collector_to_walk() -> None:
    """A served process caches tens of thousands of blocks; a full collection (GIL held)
    must not walk an object per block. 10 and 1,000 cached blocks leave the same count."""
    counts = []
    for chains in (2, 200):
        kv = KVCacheManager(4096, 4, enable_prefix_caching=True)
        for c in range(chains):
            prompt = tokens(21, c * 1000)
            assert kv.allocate(f"r{c}", 21)
            kv.cache_computed(f"r{c}", prompt, 21)
            kv.free(f"r{c}")
        assert kv.prefix is not None and kv.prefix.num_cached_blocks == chains * 5
        assert kv.match(tokens(21, 1000)) == kv.prefix.match(tokens(21, 1000), 5)
        gc.collect()
        gc.collect()
        counts.append(_tracked_reachable(kv.prefix, kv.pool))
        kv.check_integrity()
    assert counts[0] == counts[1], counts


def test_evicting_an_inner_block_drops_its_subtree_children_first() -> None:
    """Released parent first (the LRU block is then an inner node): evicting it frees its
    whole subtree, a branch included, and the tree forgets each of them; a namespace's
    tree of the same tokens stays."""
    pool = BlockPool(8)
    cache = PrefixCache(pool, block_size=2)
    trunk = pool.allocate(3)
    branch = pool.allocate(1)
    other = pool.allocate(1)
    assert cache.insert([1, 2, 3, 4, 5, 6], trunk) == 3
    assert cache.insert([1, 2, 7, 8], [trunk[0], branch[0]]) == 2
    assert cache.insert([1, 2], other, namespace="adapter") == 1
    pool.release(trunk)  # trunk[0] is the least recently released
    pool.release(branch + other)
    cache.check_integrity()
    assert cache.evict(1) == 4  # trunk[0] with trunk[1], trunk[2] and the branch
    assert cache.num_evicted == 4 and cache.cached_blocks() == set(other)
    assert pool.num_free_blocks == 7 and not any(pool.is_cached(b) for b in trunk + branch)
    assert cache.match([1, 2, 3, 4, 5, 6, 0], 3) == []
    assert cache.match([1, 2, 0], 1, namespace="adapter") == other
    cache.check_integrity()
    assert cache.evict(5) == 1 and cache.num_cached_blocks == 0
    cache.check_integrity()


def test_random_publishing_and_eviction_match_a_reference_of_prefixes() -> None:
    """Prompts over a 3-token alphabet (shared prefixes, branches, re-publishing of what is
    cached) into a 24-block pool: after every step the tree is whole and `match` finds
    exactly the cached prefixes a plain dict of them finds; `partial` agrees with it too."""
    rng = random.Random(0)
    pool = BlockPool(24)
    cache = PrefixCache(pool, block_size=2)
    reference: dict[tuple[int, ...], int] = {}  # a cached block's whole prefix -> the block

    def expected(tokens: list[int], max_blocks: int) -> list[int]:
        found = []
        for i in range(min(max_blocks, len(tokens) // 2)):
            block = reference.get(tuple(tokens[: 2 * (i + 1)]))
            if block is None:
                break
            found.append(block)
        return found

    for _ in range(1500):
        tokens = [rng.randint(0, 2) for _ in range(2 * rng.randint(1, 6))]
        n = len(tokens) // 2
        matched = cache.match(tokens, n)
        assert matched == expected(tokens, n)
        pool.acquire(matched)
        if n - len(matched) > pool.num_available_blocks:
            pool.release(reversed(matched))
            continue
        before = cache.cached_blocks()
        table = matched + pool.allocate(n - len(matched))  # may evict
        dropped = before - cache.cached_blocks()
        reference = {prefix: b for prefix, b in reference.items() if b not in dropped}
        cached = cache.insert(tokens, table)
        for i in range(len(matched), cached):
            reference[tuple(tokens[: 2 * (i + 1)])] = table[i]
        pool.release(reversed(table))
        cache.check_integrity()
        probe = [rng.randint(0, 2) for _ in range(7)]
        hit = cache.match(probe, 3)
        assert hit == expected(probe, 3)
        got = cache.partial(probe, hit, 1)
        assert got is None or (got[1] == 1 and tuple(probe[: 2 * len(hit) + 1]) == next(
            p[: 2 * len(hit) + 1] for p, b in reference.items() if b == got[0]))
    assert cache.num_evicted > 0 and len(reference) == cache.num_cached_blocks
