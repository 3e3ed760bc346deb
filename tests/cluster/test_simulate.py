"""The planning simulator: exact costs on a trivial trace, and the effects it exists to
show (prefix routing reuses, disaggregation respects backpressure, pools move)."""

from __future__ import annotations

import pytest

from prelude.cluster.pools import PoolConfig
from prelude.cluster.router import RouterConfig
from prelude.cluster.simulate import SimConfig, Simulator, StepCost, TraceRequest, synthetic_trace

COST = StepCost(a=2e-8, b=1.5e-4, g=1e-6, c=0.01)


def test_one_request_costs_what_the_model_says() -> None:
    r = Simulator(SimConfig(instances=1), COST).run([TraceRequest(1.0, tuple(range(100)), 5, 1.0)])
    assert r.ttft == [pytest.approx(COST.prefill_seconds(100))]
    # decode steps at contexts 100..103 (the first token came with the prefill)
    steps = [COST.seconds([(1, 100 + k)]) for k in range(4)]
    assert r.tpot == [pytest.approx(sum(steps) / 4)]
    assert r.slo_violations == 0 and r.finished == 1


def test_fit_recovers_coefficients() -> None:
    rows = [[(L, H)] for L in (1, 16, 128, 512, 1024) for H in (0, 64, 512)] + [[(1, 100)] * 8]
    fitted = StepCost.fit([(r, COST.seconds(r)) for r in rows])
    for x, y in zip((fitted.a, fitted.b, fitted.g, fitted.c), (COST.a, COST.b, COST.g, COST.c)):
        assert x == pytest.approx(y, rel=1e-3)


def test_prefix_routing_reuses_more_than_round_robin() -> None:
    trace = synthetic_trace(400, 20.0, seed=3, short_len=(300, 400), long_fraction=0.0, output_len=(4, 8),
                            shared_prefixes=16, prefix_len=256)
    # Each instance's cache holds ~4 of the 16 prefixes: spraying them thrashes it.
    rr = Simulator(SimConfig(instances=4, cache_blocks=100, router=RouterConfig("round_robin")), COST).run(trace)
    px = Simulator(SimConfig(instances=4, cache_blocks=100, router=RouterConfig("prefix")), COST).run(trace)
    assert px.prefix_hit_rate > 1.5 * rr.prefix_hit_rate and px.finished == rr.finished == 400


def test_disaggregated_holds_backpressure_and_finishes_everything() -> None:
    trace = synthetic_trace(300, 200.0, seed=1, output_len=(20, 40))  # a burst
    sim = Simulator(SimConfig(instances=4, mode="disaggregated", decode_instances=1, max_requests_in_scheduler=8), COST)
    peak = 0
    real_place = sim.placer.place

    def place(cands=None):  # noqa: ANN001, ANN202 - watch the decode side's occupancy
        nonlocal peak
        d = real_place(cands)
        peak = max(peak, max(sim.placer.held))
        return d

    sim.placer.place = place  # type: ignore[method-assign]
    r = sim.run(trace)
    assert r.finished == 300 and r.backpressure_waits > 0 and peak == 8


def test_laps_pools_move_under_pressure() -> None:
    trace = synthetic_trace(600, 60.0, seed=2, long_fraction=0.6, output_len=(4, 8))
    r = Simulator(SimConfig(instances=4, laps_pools=(2, 2), pool_config=PoolConfig(boundary=512, cooldown_s=0.5)),
                  COST).run(trace)
    assert r.finished == 600 and r.pool_moves >= 1
