"""Queue-order policies, chosen by name (`--policy`)."""

from __future__ import annotations

from typing import Callable

from prelude.engine.policies.base import SchedulingPolicy
from prelude.engine.policies.fcfs import FCFSPolicy

POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {sorted(POLICIES)}") from None
