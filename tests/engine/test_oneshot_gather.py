"""Gathering a burst of OneShot requests into one step (engine/oneshot_gather.py): the rule
with a fake clock, then the scheduler holding a OneShot-only step and letting it go."""

from __future__ import annotations

import random

import pytest

from prelude import SamplingParams
from prelude.engine.oneshot_gather import GAP_S, LONE_MIN_TOKENS, BurstGather
from prelude.engine.request import Request
from prelude.engine.validation import RequestRules, validate_request
from prelude.forward_batch import OneShotBatch
from tests.engine.test_policies import make_request, make_scheduler

GEN = random.Random(0)


def oneshot(rid: str, arrival: float) -> Request:
    rules = RequestRules(max_model_len=4096, vocab_size=100, eos_token_ids=frozenset())
    return validate_request(rid, [1 + i % 50 for i in range(40)], SamplingParams(temperature=0.0, max_tokens=1), rules,
                            seed_source=GEN, arrival_time=arrival)


def test_gather_waits_for_the_burst_and_no_longer() -> None:
    g = BurstGather(max_wait_s=0.05)
    assert not g.hold([oneshot("a", 0.0)], 0.001)  # no OneShot step timed yet: nothing expected
    g.observe(0.5)  # a 0.5 s step: holds of at most 25 ms (5%), arrival gaps of 10 ms (2%)
    g.step_ended(finished=4, waiting=0, now=10.0)
    early = [oneshot("a", 10.002)]
    assert g.hold(early, 10.003)  # 1 of 4 back, the burst still coming
    assert not g.hold(early, 10.002 + 0.011)  # a quiet stretch longer than the gap ends it
    assert not g.hold([oneshot(str(i), 10.002) for i in range(4)], 10.003)  # all 4 back: go
    # before the first answer comes back, the round trip is waited out, up to the bound
    stale = [oneshot("old", 9.0)]
    assert g.hold(stale, 10.02)
    assert not g.hold(stale, 10.026)


def test_gather_gap_grows_with_the_step_on_a_busy_machine() -> None:
    g = BurstGather(max_wait_s=0.25)
    g.observe(10.0)  # a 10 s step (a loaded machine): 200 ms gaps, holds capped at 250 ms
    g.step_ended(finished=16, waiting=0, now=1.0)
    burst = [oneshot("a", 1.1), oneshot("b", 1.15)]
    assert g.hold(burst, 1.24)  # 90 ms after the last arrival: more than GAP_S, less than 2% of the step
    assert GAP_S < 0.09 and not g.hold(burst, 1.26)  # the cap


def test_gather_is_bounded_by_the_step_and_can_be_off() -> None:
    g = BurstGather(max_wait_s=0.05)
    g.observe(0.1)  # a 100 ms step: at most 5 ms of waiting
    g.step_ended(finished=8, waiting=0, now=1.0)
    assert g.hold([oneshot("a", 0.5)], 1.004)
    assert not g.hold([oneshot("a", 0.5)], 1.006)
    off = BurstGather(max_wait_s=0.0)
    off.observe(1.0)
    off.step_ended(finished=8, waiting=0, now=1.0)
    assert not off.hold([oneshot("a", 1.0)], 1.001)


def _first_burst_done(s, check=None) -> float:  # noqa: ANN001
    """Run a first OneShot step of 4 rows (1 s) to its end (`check` sees its plan): the
    gather then expects 4 requests back. Returns when that step ended (the gather's opening)."""
    first = [oneshot(f"r{i}", 0.0) for i in range(4)]
    for r in first:
        s.add(r)
    plan = s.schedule(now=0.0)
    if check is not None:
        check(plan)
    s.observe_step(plan.batch, 1.0)
    s.end_step(plan, ok=True)
    for r in first:
        s.finish(r)
    return s.gather.opened


def test_scheduler_holds_a_oneshot_step_for_its_burst_then_runs_it_whole() -> None:
    s = make_scheduler("fcfs", budget=1024)

    def whole(plan) -> None:  # noqa: ANN001
        assert isinstance(plan.batch, OneShotBatch) and len(plan.batch.rows) == 4

    opened = _first_burst_done(s, whole)
    s.add(oneshot("n0", opened + 0.001))
    held = s.schedule(now=opened + 0.002)
    assert held.batch is None  # 1 of the 4 expected is back
    assert held.hold_s == pytest.approx(0.02 - 0.001)  # if no other comes: a gap of 2% of the 1 s step
    for i in range(1, 4):
        s.add(oneshot(f"n{i}", opened + 0.002))
    plan = s.schedule(now=opened + 0.003)
    assert isinstance(plan.batch, OneShotBatch) and [r.request_id for r in plan.batch.rows] == ["n0", "n1", "n2", "n3"]


def test_scheduler_never_holds_past_the_cap_or_with_paged_work() -> None:
    s = make_scheduler("fcfs", budget=1024)
    opened = _first_burst_done(s)
    s.add(oneshot("late", opened + 0.001))
    assert s.schedule(now=opened + 0.06).batch is not None  # past the 50 ms cap
    # a paged request in the engine: OneShot rows ride with it, nothing waits
    s2 = make_scheduler("fcfs", budget=1024)
    s2.gather.observe(1.0)
    s2.gather.step_ended(finished=4, waiting=0, now=opened)
    s2.add(make_request("paged", 8, 4, opened))
    s2.add(oneshot("one", opened + 0.001))
    plan = s2.schedule(now=opened + 0.002)
    assert plan.batch is not None and [r.request_id for r in plan.oneshot] == ["one"]


def test_an_unannounced_burst_is_gathered_for_a_twentieth_of_its_step() -> None:
    g = BurstGather(max_wait_s=0.05)
    two = [oneshot("a", 1.000), oneshot("b", 1.002)]
    assert not g.hold(two, 1.003)  # no step timed yet: no estimate of the step to bound the hold
    g.observe(0.4, tokens=400)  # 1 ms a token: the two 40-token prompts make an ~80 ms step
    assert not g.hold(two[:1], 1.001)  # a lone short request never waits
    long = [validate_request("long", [1 + i % 50 for i in range(LONE_MIN_TOKENS)],
                             SamplingParams(temperature=0.0, max_tokens=1),
                             RequestRules(max_model_len=4096, vocab_size=100, eos_token_ids=frozenset()),
                             seed_source=GEN, arrival_time=1.0)]
    # a lone long one waits for company: 5% of its ~512 ms step (25.6 ms), gaps up to 2% of it (10.2 ms)
    assert g.hold(long, 1.0 + GAP_S + 0.001)
    assert not g.hold(long, 1.0105)
    # a step takes at most its budget's tokens: 100 of them bound the step at ~100 ms, the hold at 5 ms
    assert g.hold(long, 1.0045, step_tokens=100)
    assert not g.hold(long, 1.0051, step_tokens=100)
    assert g.hold(two, 1.003)  # two in, the second just now: more may be on the way
    assert not g.hold(two, 1.0045)  # 5% of the step (4 ms) after the first
    assert not g.hold([oneshot("a", 1.0), oneshot("b", 1.0)], 1.0035 + GAP_S)  # a quiet gap ends it
    # a step the burst announced (8 expected, 8 back) goes at once
    g.step_ended(finished=8, waiting=0, now=2.0)
    assert not g.hold([oneshot(str(i), 2.001) for i in range(8)], 2.002)


def test_scheduler_gathers_an_unannounced_burst_into_one_step() -> None:
    s = make_scheduler("fcfs", budget=1024)
    s.gather.observe(0.4, tokens=400)
    s.add(oneshot("a", 5.000))
    s.add(oneshot("b", 5.001))
    assert s.schedule(now=5.002).batch is None  # the burst is still coming
    s.add(oneshot("c", 5.0025))
    plan = s.schedule(now=5.0025 + GAP_S + 0.0001)  # past 5% of ~120 ms (6 ms) from the first
    assert isinstance(plan.batch, OneShotBatch) and [r.request_id for r in plan.batch.rows] == ["a", "b", "c"]


def test_scheduler_never_holds_a_step_its_waiting_prompts_already_fill() -> None:
    s = make_scheduler("fcfs", budget=80)  # two 40-token prompts with nothing in common fill a step
    s.gather.observe(0.4, tokens=400)
    rules = RequestRules(max_model_len=4096, vocab_size=100, eos_token_ids=frozenset())
    for rid, token, at in (("a", 7, 5.000), ("b", 9, 5.001)):
        s.add(validate_request(rid, [token] * 40, SamplingParams(temperature=0.0, max_tokens=1), rules,
                               seed_source=GEN, arrival_time=at))
    plan = s.schedule(now=5.002)  # just in, but nothing more would fit
    assert isinstance(plan.batch, OneShotBatch) and [r.request_id for r in plan.batch.rows] == ["a", "b"]


def test_peers_sharing_a_prefix_do_not_fill_a_step_with_it() -> None:
    """Two 40-token prompts fill an 80-token step; two that share 32 of them (a cold
    prefix the second rides on) leave room: the burst is still gathered."""
    s = make_scheduler("fcfs", budget=80)
    s.gather.observe(0.4, tokens=400)
    rules = RequestRules(max_model_len=4096, vocab_size=100, eos_token_ids=frozenset())
    shared = [1 + i % 50 for i in range(32)]
    for rid, tail, at in (("a", [60] * 8, 5.000), ("b", [70] * 8, 5.001)):
        s.add(validate_request(rid, shared + tail, SamplingParams(temperature=0.0, max_tokens=1), rules,
                               seed_source=GEN, arrival_time=at))
    assert s.schedule(now=5.002).batch is None  # 48 of 80 tokens: more may join


def test_a_hold_says_how_long_it_lasts_if_nothing_arrives() -> None:
    """The loop naps no longer than this (async_engine.py): the earliest of the hold's bounds."""
    g = BurstGather(max_wait_s=0.05)
    g.observe(0.1)  # a 100 ms step: holds of at most 5 ms, gaps of GAP_S
    g.step_ended(finished=4, waiting=0, now=1.0)
    assert g.hold([oneshot("old", 0.5)], 1.001) == pytest.approx(0.004)  # the round trip, to the 5 ms bound
    assert g.hold([oneshot("a", 1.002)], 1.003) == pytest.approx(min(0.005 - 0.003, GAP_S - 0.001))
    assert g.hold([oneshot("a", 1.002)], 1.006) == 0.0
    lone = BurstGather(max_wait_s=0.05)
    lone.observe(0.4, tokens=400)  # 1 ms a token: a lone 512-token prompt's step ~512 ms
    long = [validate_request("long", [1 + i % 50 for i in range(LONE_MIN_TOKENS)],
                             SamplingParams(temperature=0.0, max_tokens=1),
                             RequestRules(max_model_len=4096, vocab_size=100, eos_token_ids=frozenset()),
                             seed_source=GEN, arrival_time=1.0)]
    # 5% of the step (25.6 ms) after it came, 2% of it (10.24 ms) after the newest: the gap first
    assert lone.hold(long, 1.001) == pytest.approx(0.01024 - 0.001)
