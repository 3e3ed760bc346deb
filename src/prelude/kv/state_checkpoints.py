"""State checkpoints: slots of the state pool that keep a cached prefix's recurrent state.

A model with recurrent layers can reuse a cached prefix only together with the state at
its end. Checkpoint slots sit in the same state tensors as the running slots, after them
(slot ids first_slot .. first_slot + num_slots - 1). A checkpoint slot is
- free;
- pending: allocated for a step that writes a state into it, held by that step until the
  prefix cache attaches it to a radix node (or the step fails and it is freed);
- attached: the state at a position of a cached prefix (the prefix cache maps it). Holders
  (a row that restores it in a step not yet run) pin it; an unpinned attached checkpoint is
  evictable, least recently used first.
An attached checkpoint dies with its node (the prefix cache detaches it) or under memory
pressure (a new checkpoint needs its slot).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable


class StateCheckpoints:
    def __init__(self, num_slots: int, first_slot: int) -> None:
        if num_slots < 1:
            raise ValueError("the checkpoint pool needs at least one slot")
        self.num_slots = num_slots
        self.first_slot = first_slot
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._holds: dict[int, int] = {}
        self._attached: set[int] = set()
        self._evictable: OrderedDict[int, None] = OrderedDict()  # attached and unpinned, LRU first
        # Set by the prefix cache: forgets an evictable checkpoint's place in the tree.
        self._forget: Callable[[int], None] | None = None
        self.num_evicted = 0

    def set_forget(self, forget: Callable[[int], None]) -> None:
        self._forget = forget

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_attached(self) -> int:
        return len(self._attached)

    def allocate(self) -> int | None:
        """A pending slot (held once), evicting the LRU unpinned checkpoint when none is
        free; None when every slot is pending or pinned."""
        if not self._free:
            victim = next(iter(self._evictable), None)
            if victim is None:
                return None
            if self._forget is not None:
                self._forget(victim)
            self.detach(victim)
            self.num_evicted += 1
        slot = self._free.pop()
        self._holds[slot] = 1
        return slot

    def hold(self, slot: int) -> None:
        """Pin an attached checkpoint (a row restores it in a step not yet run)."""
        if slot not in self._attached:
            raise RuntimeError(f"checkpoint slot {slot} held while not attached")
        self._evictable.pop(slot, None)
        self._holds[slot] = self._holds.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        n = self._holds.get(slot, 0)
        if n <= 0:
            raise RuntimeError(f"checkpoint slot {slot} released more often than held")
        if n > 1:
            self._holds[slot] = n - 1
            return
        del self._holds[slot]
        if slot in self._attached:
            self._evictable[slot] = None  # most recently used last
        else:
            self._free.append(slot)

    def attach(self, slot: int) -> None:
        """A pending slot becomes a checkpoint of the tree; the step's hold ends."""
        if slot in self._attached:
            raise RuntimeError(f"checkpoint slot {slot} attached twice")
        self._attached.add(slot)
        self.release(slot)

    def touch(self, slot: int) -> None:
        """A hit used it: it is the most recently used."""
        if slot in self._evictable:
            self._evictable.move_to_end(slot)

    def detach(self, slot: int) -> None:
        """Its node left the tree: free it now, or when its last holder lets go."""
        self._attached.remove(slot)
        self._evictable.pop(slot, None)
        if slot not in self._holds:
            self._free.append(slot)

    def is_held(self, slot: int) -> bool:
        return bool(self._holds.get(slot))

    def check_integrity(self, held: Iterable[int], attached: set[int]) -> None:
        """Every slot is free, attached (the tree's `attached`), or held exactly as often as
        `held` lists it."""
        expected: dict[int, int] = {}
        for s in held:
            expected[s] = expected.get(s, 0) + 1
        if expected != self._holds:
            raise AssertionError(f"checkpoint holds {self._holds} != held {expected}")
        if attached != self._attached:
            raise AssertionError(f"checkpoints attached {sorted(self._attached)}, the tree has {sorted(attached)}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a checkpoint slot is on the free list twice")
        if free & (attached | set(self._holds)):
            raise AssertionError("a checkpoint slot is free and in use")
        if set(self._evictable) != {s for s in attached if s not in self._holds}:
            raise AssertionError("checkpoint LRU out of date")
        if len(free | attached | set(self._holds)) != self.num_slots:
            raise AssertionError(f"checkpoint slots leaked: {self.num_slots - len(free | attached | set(self._holds))}")
