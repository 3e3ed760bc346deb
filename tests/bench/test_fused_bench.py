"""The fused-vs-alternating trial driver on the tiny engine: every chat stream and every
classify arrival is answered and counted, in both modes, and the pool stays whole."""

from __future__ import annotations

import pytest

from prelude.bench.fused_bench import Trace, run_trial, summarize

from tests.engine.tiny import hf_tiny_llama, tiny_engine

pytest.importorskip("transformers")


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "alternating"])
def test_trial_counts_every_request(fuse: bool) -> None:
    engine = tiny_engine(hf_tiny_llama(), fuse_oneshot=fuse)
    streams = [[[1 + s, 2, 3, 4 + k] for k in range(64)] for s in range(2)]
    classify = [(0.05 * i, [10 + i, 11, 12, 13, 14]) for i in range(8)]
    result = run_trial(engine, Trace(streams, classify), 0.5, 4, (5, 6), "t")
    s = summarize(result)
    assert s["oneshot_done"] == 8 and s["decode_requests"] >= 2
    assert s["tpot_ms_p99"] >= s["tpot_ms_p50"] > 0 and s["oneshot_e2e_ms_p99"] >= s["oneshot_e2e_ms_p50"] > 0
    assert not engine.has_unfinished() and engine.kv.num_available_blocks == engine.kv.pool.num_blocks
