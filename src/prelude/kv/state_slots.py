"""Recurrent-state slots: the state pool of models with linear-attention layers.

A slot holds one sequence's recurrent state (every linear layer's conv inputs and delta
rule state); a paged request holds one from its first allocation until it is freed, as
it holds its blocks. OneShot rows hold none: their state lives in their one forward.
"""

from __future__ import annotations

from collections.abc import Iterable


class NoFreeSlotsError(RuntimeError):
    pass


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlotsError(f"all {self.num_slots} state slots are held")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"state slot {slot} released while free")
        self._free.append(slot)

    def check_integrity(self, held: Iterable[int]) -> None:
        """Every slot is free or held by exactly one holder."""
        held = list(held)
        if len(set(held)) != len(held):
            raise AssertionError("a state slot is held twice")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a state slot is on the free list twice")
        if free & set(held):
            raise AssertionError(f"state slots both free and held: {sorted(free & set(held))}")
        if len(free) + len(held) != self.num_slots:
            raise AssertionError(f"state slots leaked: {self.num_slots - len(free) - len(held)}")
