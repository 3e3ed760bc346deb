"""Queue-order policies, chosen by name (`--policy`): fcfs, srpt, mlfq, laps, or a
prefill+decode pair such as `srpt+mlfq` or `laps+mlfq`."""

from __future__ import annotations

from typing import Callable

from prelude.config import PolicyConfig
from prelude.engine.policies.base import DecodePolicy, PrefillChoice, PrefillPolicy, SchedulingPolicy
from prelude.engine.policies.fcfs import FCFSDecode, FCFSPrefill
from prelude.engine.policies.laps import LAPSPrefill
from prelude.engine.policies.mlfq import DEFAULT_QUANTA, MLFQDecode
from prelude.engine.policies.srpt import SRPTPrefill

__all__ = ["DEFAULT_QUANTA", "DecodePolicy", "PrefillChoice", "PrefillPolicy", "SchedulingPolicy", "make_policy"]


def _prefill(name: str, o: PolicyConfig) -> PrefillPolicy:
    makers: dict[str, Callable[[], PrefillPolicy]] = {
        "fcfs": FCFSPrefill,
        "srpt": lambda: SRPTPrefill(o.srpt_starvation_s),
        "laps": lambda: LAPSPrefill(o.laps_boundary, o.laps_long_chunk, deadline_free=o.laps_deadline_free,
                                    **({"depth_buckets": o.depth_buckets} if o.depth_buckets else {})),
    }
    if name not in makers:
        raise ValueError(f"unknown prefill policy {name!r}; known: {sorted(makers)}")
    return makers[name]()


def _decode(name: str, o: PolicyConfig) -> DecodePolicy:
    makers: dict[str, Callable[[], DecodePolicy]] = {
        "fcfs": FCFSDecode,
        "mlfq": lambda: MLFQDecode(o.mlfq_quanta, o.mlfq_starvation_steps),
    }
    if name not in makers:
        raise ValueError(f"unknown decode policy {name!r}; known: {sorted(makers)}")
    return makers[name]()


def make_policy(name: str, options: PolicyConfig | None = None) -> SchedulingPolicy:
    """`fcfs`, `srpt` (srpt+fcfs), `mlfq` (fcfs+mlfq), `laps` (laps+fcfs), or `P+D`."""
    o = options or PolicyConfig()
    if "+" in name:
        prefill, decode = name.split("+", 1)
    elif name == "mlfq":
        prefill, decode = "fcfs", "mlfq"
    else:
        prefill, decode = name, "fcfs"
    return SchedulingPolicy(_prefill(prefill, o), _decode(decode, o))
