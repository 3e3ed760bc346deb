"""The soak's default-suite version: 500 mixed requests at c=32 with 10% client cancels
and malformed requests against a real server over the tiny engine; the books add up,
no 5xx, the block pool is intact with every block free or cached, RSS is flat."""

from __future__ import annotations

import asyncio
import os

import pytest

from prelude.bench.soak import SoakSpec, rss_mib, run_soak
from prelude.engine.async_engine import AsyncEngine

from tests.engine.tiny import hf_tiny_llama, tiny_engine
from tests.entrypoints.conftest import running_server

pytest.importorskip("transformers")


def test_soak_500_requests() -> None:
    engine = tiny_engine(hf_tiny_llama(), num_blocks=256, max_model_len=512, max_num_seqs=32)  # fits every prompt
    spec = SoakSpec(requests=500, concurrency=32, cancel_fraction=0.10, seed=1, warmup_fraction=0.2)
    with running_server(AsyncEngine(engine)) as base:
        result = asyncio.run(run_soak(base, spec, lambda: rss_mib(os.getpid())))
    assert result.verdict(spec) == [], (result.verdict(spec), result.failures[:5])
    assert result.total == 500 and set(result.outcomes) <= {"answered", "rejected", "cancelled"}
    # Invariants, not counts that a machine's speed decides: every request the client read to
    # the end is answered (malformed: rejected), and every planned cancel of a stream (made on
    # its first event, not after a delay) is a cancel.
    for key, outcomes in result.by_plan.items():
        plan, kind = key.split(":")
        if plan == "keep":
            assert set(outcomes) == ({"rejected"} if kind == "malformed" else {"answered"}), (key, outcomes)
    assert result.streams_cancelled_planned > 10  # the seed's plan: streams left mid-request
    assert result.outcomes["cancelled"] >= result.streams_cancelled_planned
    assert set(result.by_kind) == {"chat_stream", "completion_stop", "completion_n", "classify", "embed", "score",
                                   "prompt_logprobs", "malformed"}
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks
