"""The sliding layers' window pool (kv/window_tables.py) through the KV manager: a request's
window table stays within window / block + 1 blocks while a long prompt runs in chunks and
decodes, its blocks return to the pool, prefix hits longer than the window keep the window
blocks they need (or are shortened when those were evicted), and OneShot steps pair what
they publish."""

from __future__ import annotations

import pytest

from prelude.kv.kv_manager import KVCacheManager
from prelude.kv.window_tables import RELEASED

BS, WINDOW = 4, 8
BOUND = WINDOW // BS + 1


def _manager(window_blocks: int = 64, blocks: int = 64, prefix: bool = True) -> KVCacheManager:
    return KVCacheManager(blocks, BS, enable_prefix_caching=prefix, window=WINDOW, num_window_blocks=window_blocks)


def _held(kv: KVCacheManager, rid: str) -> int:
    table = kv.window_table(rid)
    assert table is not None
    return sum(b != RELEASED for b in table)


def _run(kv: KVCacheManager, rid: str, tokens: list[int], chunk: int, done: int = 0) -> list[int]:
    """A paged request's steps as the scheduler takes them: allocate, (forward), publish and
    slide; the window blocks it holds after each step."""
    held = []
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert kv.allocate(rid, done + n)
        # during the step: the chunk's blocks and the window its first query reads
        table = kv.window_table(rid)
        assert table is not None and len(table) == len(kv.block_table(rid))
        first = max(0, done - WINDOW + 1) // BS
        assert all(b != RELEASED for b in table[first:])  # what the step reads and writes is there
        done += n
        kv.cache_computed(rid, tokens, done)
        kv.advance(rid, done)
        held.append(_held(kv, rid))
        kv.check_integrity()
    return held


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_a_long_prompt_and_its_decode_hold_at_most_the_window_plus_a_block(chunk: int) -> None:
    kv = _manager(prefix=False)
    prompt = list(range(4 * WINDOW + 3))
    held = _run(kv, "r", prompt, chunk)  # the prompt in chunks
    held += _run(kv, "r", prompt + list(range(20)), 1, done=len(prompt))  # then decode, a token a step
    assert max(held) <= BOUND
    assert min(held[len(held) // 2 :]) >= WINDOW // BS  # and it keeps the window (it is no smaller)
    assert len(kv.block_table("r")) == (len(prompt) + 20 + BS - 1) // BS  # the global layers keep everything
    assert kv.windows is not None and kv.windows.pool.num_free_blocks == 64 - held[-1]
    kv.free("r")
    assert kv.windows.pool.num_free_blocks == 64 and kv.pool.num_free_blocks == 64  # all back to the pools
    kv.check_integrity()


def test_the_window_pool_bounds_admission_apart_from_the_global_pool() -> None:
    kv = _manager(window_blocks=5)
    assert kv.allocate("a", 16)  # 4 window blocks
    assert not kv.allocate("b", 8)  # 2 more: the window pool has 1 left (the global one has plenty)
    assert kv.block_table("b") == [] and kv.window_table("b") == []
    kv.advance("a", 16)  # a's next query reads from position 9 on: block 2
    assert _held(kv, "a") == 2
    assert kv.allocate("b", 8)
    kv.check_integrity()


def test_a_cached_prefix_longer_than_the_window_hits_with_its_last_window() -> None:
    kv = _manager()
    shared = list(range(100, 100 + 6 * BS))  # 6 blocks: three windows
    _run(kv, "a", shared + [1, 2, 3], 5)
    kv.free("a")
    kv.check_integrity()
    prompt = shared + [7, 8]
    hit = kv.match(prompt)
    assert len(hit) == 6  # the whole shared part: its window blocks were kept as partners
    kv.attach("b", hit)
    table = kv.window_table("b")
    assert table is not None and len(table) == 6
    first = (6 * BS - WINDOW + 1) // BS
    assert all(b == RELEASED for b in table[:first]) and all(b != RELEASED for b in table[first:])
    assert _held(kv, "b") <= BOUND
    kv.check_integrity()
    kv.free("b")
    kv.check_integrity()


def test_a_hit_whose_window_blocks_were_evicted_is_shortened_never_wrong() -> None:
    kv = _manager(window_blocks=12)
    shared = list(range(100, 100 + 6 * BS))
    _run(kv, "a", shared + [1], 4)  # releases window blocks 0-3 as it slides, then 5 and 4 at its end
    kv.free("a")
    assert kv.windows is not None
    assert kv.windows.num_partners == 6  # every full block of the prompt paired
    assert kv.allocate("x", 8 * BS)  # 6 free window blocks, then the two least recently released partners
    assert kv.windows.num_partners == 4
    assert len(kv.match(shared + [5])) == 6  # the hit's last window (blocks 4 and 5) is still there
    assert kv.allocate("x", 9 * BS)  # evicts block 2's partner: not in that window, the hit stays whole
    assert len(kv.match(shared + [5])) == 6
    assert kv.allocate("x", 11 * BS)  # evicts blocks 3 and 5's: the hit has no whole window at any end
    assert kv.match(shared + [5]) == []
    kv.check_integrity()


def test_a_hit_ends_where_its_window_is_whole() -> None:
    kv = _manager()
    assert kv.windows is not None
    nodes = [10, 11, 12, 13, 14, 15]
    blocks = kv.windows.pool.allocate(6)
    kv.windows.publish(nodes, [blocks[0], blocks[1], blocks[2], RELEASED, blocks[4], RELEASED])
    # a hit of 6 needs blocks 4-5, of 5 needs 3-4, of 4 needs 2-3, of 3 needs 1-2: 3 is the longest
    assert kv.windows.usable_hit(nodes) == 3
    assert kv.windows.usable_hit(nodes[:2]) == 2
    assert kv.windows.usable_hit([99]) == 0


def test_oneshot_steps_pin_the_prefix_window_and_pair_what_they_publish() -> None:
    kv = _manager()
    prompt = list(range(200, 200 + 5 * BS + 2))
    publish, copy_from = kv.hold_for_step([], 5)
    assert copy_from is None and len(publish) == 5
    entries = kv.step_window([], publish)
    assert entries is not None and len(entries) == 5 and RELEASED not in entries
    kv.end_step(prompt, [], publish)
    kv.check_integrity()
    assert kv.windows is not None and kv.windows.num_partners == 5
    # a second prompt hits the 5 blocks; its step pins only their last window
    other = prompt[: 5 * BS] + [9, 9, 9]
    hit = kv.match(other)
    assert hit == publish
    more, _ = kv.hold_for_step(hit, 0)
    assert more == []
    pinned = kv.step_window(hit, [])
    assert pinned is not None and pinned[: (5 * BS - WINDOW + 1) // BS] == [RELEASED] * ((5 * BS - WINDOW + 1) // BS)
    assert all(kv.windows.pool.ref_count(b) == 1 for b in pinned if b != RELEASED)
    kv.end_step(other, hit, [])
    kv.check_integrity()
    # a failed step publishes nothing and drops its holds
    publish2, _ = kv.hold_for_step([], 2)
    kv.drop_step([], publish2)
    kv.check_integrity()
    assert kv.windows.num_partners == 5


def test_no_room_in_the_window_pool_publishes_nothing_beside() -> None:
    kv = _manager(window_blocks=2)
    publish, _ = kv.hold_for_step([], 4)
    assert publish == []  # the global pool had room, the window pool did not: no publishing this step
    kv.drop_step([], publish)
    kv.check_integrity()


def test_dropping_a_cached_block_drops_its_window_partner() -> None:
    kv = _manager(blocks=8)
    prompt = list(range(300, 300 + 4 * BS))
    publish, _ = kv.hold_for_step([], 4)
    kv.end_step(prompt, [], publish)
    assert kv.windows is not None and kv.windows.num_partners == 4
    assert kv.allocate("big", 8 * BS)  # the global pool evicts every cached block, and their partners go
    assert kv.windows.num_partners == 0 and kv.match(prompt + [1]) == []
    kv.check_integrity()
