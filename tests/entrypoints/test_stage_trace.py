"""`--trace-stages`: one request's host time broken down by stage, read at /debug/stages."""

from __future__ import annotations

import httpx

from prelude.engine.async_engine import AsyncEngine
from prelude.engine.stage_trace import STAGES, StageTrace, current

from tests.engine.tiny import hf_tiny_llama, tiny_engine
from tests.entrypoints.conftest import running_server


def test_stage_trace_sums_repeats_and_orders_by_time() -> None:
    trace = StageTrace(started=10.0)
    trace.mark("forward", 10.5)
    trace.mark("tokenize", 10.25)  # appended late (another thread), earlier in time
    trace.mark("forward", 11.0)
    assert trace.stages() == {"tokenize": 0.25, "forward": 0.75}
    assert trace.total == 1.0


def test_marks_without_a_trace_do_nothing() -> None:
    assert current.get() is None
    from prelude.engine.stage_trace import mark

    mark("tokenize")  # no trace in this context: nothing to record, nothing raised


def _front() -> AsyncEngine:
    return AsyncEngine(tiny_engine(hf_tiny_llama(), num_blocks=64, max_model_len=128))


def test_traced_requests_report_every_stage_in_order() -> None:
    with running_server(_front(), trace_stages=True) as base:
        oneshot = httpx.post(base + "/v1/completions", json={"prompt": "hello there", "max_tokens": 1}, timeout=30)
        decode = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True,
                                                            "stream": True}, timeout=30)
        assert oneshot.status_code == decode.status_code == 200
        got = httpx.get(base + "/debug/stages", timeout=10).json()
        again = httpx.get(base + "/debug/stages", timeout=10).json()
    assert got["stages"] == list(STAGES)
    first, second = got["data"]
    assert first["route"] == second["route"] == "/v1/completions" and first["status"] == 200
    # A OneShot request passes every stage once, in the documented order.
    assert list(first["stages_s"]) == list(STAGES)
    assert abs(sum(first["stages_s"].values()) - first["total_s"]) < 1e-6
    # A 4-token decode passes the step stages once per step: their sum still adds up.
    assert set(second["stages_s"]) == set(STAGES)
    assert abs(sum(second["stages_s"].values()) - second["total_s"]) < 1e-6
    assert again["data"] == []  # each breakdown is returned once


def test_stages_route_is_off_by_default() -> None:
    with running_server(_front(), trace_stages=False) as base:
        assert httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30).status_code == 200
        r = httpx.get(base + "/debug/stages", timeout=10)
    assert r.status_code == 404 and "--trace-stages" in r.json()["error"]["message"]
