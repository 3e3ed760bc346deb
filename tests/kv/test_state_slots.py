"""Recurrent-state slots in the KV manager: one per paged request, from its first
allocation to its free; counted by the integrity check like blocks."""

from __future__ import annotations

import pytest

from prelude.kv.kv_manager import KVCacheManager
from prelude.kv.state_slots import NoFreeSlotsError, StateSlots


def test_a_request_takes_one_slot_with_its_first_allocation_and_gives_it_back() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, num_state_slots=2)
    assert kv.allocate("a", 5) and kv.allocate("a", 9)  # growing keeps the same slot
    assert kv.state_slot("a") == 0 and kv.num_free_slots == 1
    assert kv.allocate("b", 1)
    assert kv.allocate("c", 1) is False  # blocks are free, but no slot: not admitted
    assert kv.block_table("c") == [] and kv.state_slot("c") is None
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_slots == 1 and kv.allocate("c", 1) and kv.state_slot("c") == 0
    kv.free("b")
    kv.free("c")
    kv.check_integrity()
    assert kv.num_free_slots == 2 and kv.num_free_blocks == 8


def test_no_slot_is_taken_when_the_blocks_do_not_fit() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, num_state_slots=2)
    assert kv.allocate("big", 100) is False
    assert kv.num_free_slots == 2 and not kv.holders()


def test_a_model_without_recurrent_layers_has_no_slots() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 3) and kv.state_slot("a") is None and kv.num_free_slots is None


def test_the_integrity_check_counts_slots() -> None:
    slots = StateSlots(3)
    held = [slots.allocate(), slots.allocate()]
    slots.check_integrity(held)
    with pytest.raises(AssertionError, match="leaked"):
        slots.check_integrity(held[:1])
    with pytest.raises(AssertionError, match="twice"):
        slots.check_integrity([held[0], held[0]])
    slots.release(held[0])
    with pytest.raises(RuntimeError, match="released while free"):
        slots.release(held[0])
    slots.allocate()
    slots.allocate()
    with pytest.raises(NoFreeSlotsError):
        slots.allocate()
