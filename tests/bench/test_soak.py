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
    engine = tiny_engine(hf_tiny_llama(), num_blocks=256, max_model_len=256, max_num_seqs=32)
    spec = SoakSpec(requests=500, concurrency=32, cancel_fraction=0.10, seed=1, warmup_fraction=0.2)
    with running_server(AsyncEngine(engine)) as base:
        result = asyncio.run(run_soak(base, spec, lambda: rss_mib(os.getpid())))
    assert result.verdict(spec) == [], (result.verdict(spec), result.failures[:5])
    assert result.total == 500 and set(result.outcomes) <= {"answered", "rejected", "cancelled"}
    assert result.outcomes["answered"] > 300 and result.outcomes["rejected"] > 20 and result.outcomes["cancelled"] > 20
    assert set(result.by_kind) == {"chat_stream", "completion_stop", "completion_n", "classify", "embed", "score",
                                   "prompt_logprobs", "malformed"}
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks
