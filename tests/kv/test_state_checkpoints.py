"""State checkpoints in the prefix tree: hits end only where a checkpoint is, checkpoints
live on radix nodes (also inside a block), die with their node or under pressure (LRU,
never a pinned one), and the integrity check counts them."""

from __future__ import annotations

import pytest

from prelude.kv.kv_manager import KVCacheManager


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def cached(kv: KVCacheManager, rid: str, prompt: list[int]) -> None:
    """A request that computed `prompt` and let go: its full blocks stay cached."""
    assert kv.allocate(rid, len(prompt))
    kv.cache_computed(rid, prompt, len(prompt))
    kv.free(rid)


def save(kv: KVCacheManager, prompt: list[int], *positions: int) -> list[int]:
    saves = kv.save_slots(list(positions))
    assert len(saves) == len(positions)
    kv.end_saves(prompt, saves, ok=True)
    return [slot for _, slot in saves]


def make(checkpoints: int = 4, blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(blocks, 4, enable_prefix_caching=True, num_state_slots=2, num_checkpoint_slots=checkpoints,
                          checkpoint_stride=8)


def test_a_hit_ends_at_the_deepest_checkpoint_within_the_cached_prefix() -> None:
    kv = make()
    prompt = tokens(14)
    cached(kv, "a", prompt)  # blocks of 0-3, 4-7, 8-11
    assert kv.match(prompt) == [] and kv.state_hit(prompt) == (None, 12)  # K/V, but no state: no hit
    (s8,) = save(kv, prompt, 8)
    assert kv.state_slot("a") is None and s8 >= 2  # checkpoint slots come after the running slots
    hit, agreed = kv.state_hit(prompt)
    assert hit is not None and (hit.num_tokens, hit.slot, hit.copy_from) == (8, s8, None) and agreed == 12
    assert kv.match(prompt) == hit.blocks and len(hit.blocks) == 2
    (s10,) = save(kv, prompt, 10)  # inside the third block
    assert kv.state_hit(prompt)[0].num_tokens == 8  # type: ignore[union-attr]  (paged rows: block ends only)
    inside, _ = kv.state_hit(prompt, inside_blocks=True)
    assert inside is not None and (inside.num_tokens, inside.slot, len(inside.blocks)) == (10, s10, 2)
    assert inside.copy_from is not None  # the cached block whose first slots the row copies
    other = tokens(10) + [99, 98, 97]  # agrees with the third block up to 10 only
    assert kv.state_hit(other, inside_blocks=True)[0].num_tokens == 10  # type: ignore[union-attr]
    assert kv.state_hit(tokens(9) + [77, 76], inside_blocks=True)[0].num_tokens == 8  # type: ignore[union-attr]
    assert kv.state_hit(prompt[:10], inside_blocks=True)[0].num_tokens == 8  # type: ignore[union-attr]  (last token)
    kv.check_integrity()


def test_a_checkpoint_dies_with_its_block_and_a_duplicate_is_freed() -> None:
    kv = make()
    prompt = tokens(12)
    cached(kv, "a", prompt)
    save(kv, prompt, 4, 8)
    assert kv.prefix is not None and kv.checkpoints is not None
    again = kv.save_slots([8])
    kv.end_saves(prompt, again, ok=True)  # one is there already: the new slot goes back
    assert kv.prefix.num_checkpoints == 2 and kv.checkpoints.num_free_slots == 2
    failed = kv.save_slots([12])
    kv.end_saves(prompt, failed, ok=False)
    assert kv.checkpoints.num_free_slots == 2
    kv.prefix.evict(16)
    assert kv.prefix.num_checkpoints == 0 and kv.checkpoints.num_free_slots == 4
    kv.check_integrity()


def test_pressure_evicts_the_least_recently_used_unpinned_checkpoint() -> None:
    kv = make(checkpoints=2)
    prompt = tokens(12)
    cached(kv, "a", prompt)
    s4, s8 = save(kv, prompt, 4, 8)
    kv.attach("r", kv.state_hit(prompt)[0].blocks, restore=s8)  # type: ignore[union-attr]  (pinned: a row restores it)
    assert kv.restore_slot("r") == s8
    (s12,) = save(kv, prompt, 12)  # no free slot: the LRU unpinned one (at 4) goes
    assert s12 == s4 and kv.checkpoints is not None and kv.checkpoints.num_evicted == 1
    hit, _ = kv.state_hit(prompt + [1])
    assert hit is not None and (hit.num_tokens, hit.slot) == (12, s12)
    kv.attach("r2", hit.blocks, restore=s12)
    assert kv.save_slots([4]) == ()  # every slot pinned: no checkpoint this time
    kv.check_integrity()
    kv.free("r")  # the pins end with the requests
    kv.free("r2")
    kv.check_integrity()
    assert kv.checkpoints.num_free_slots + kv.prefix.num_checkpoints == 2  # type: ignore[union-attr]


def test_integrity_catches_a_leaked_checkpoint() -> None:
    kv = make()
    kv.save_slots([4])  # pending, never ended
    with pytest.raises(AssertionError, match="checkpoint"):
        kv.check_integrity()


def test_positions_on_the_stride_and_where_prompts_part() -> None:
    kv = make()
    assert kv.checkpoint_positions(0, 20) == [8, 16]
    assert kv.checkpoint_positions(8, 17, (11, 30, 8)) == [11, 16]
    assert KVCacheManager(16, 4, enable_prefix_caching=True).checkpoint_positions(0, 20) == []
    with pytest.raises(ValueError, match="multiple of the block size"):
        KVCacheManager(16, 4, enable_prefix_caching=True, num_state_slots=1, num_checkpoint_slots=1,
                       checkpoint_stride=6)
