"""Queue-order policies with a fake clock and a fake executor (no model), plus greedy
parity of every policy on the tiny model."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from prelude import SamplingParams
from prelude.config import PolicyConfig, SchedulerConfig
from prelude.engine.validation import RequestRules, validate_request
from prelude.engine.policies import make_policy
from prelude.engine.policies.laps import LAPSPrefill, StepTimeModel
from prelude.engine.request import Request
from prelude.engine.scheduler import ScheduleResult, Scheduler
from prelude.kv.kv_manager import KVCacheManager

from tests.engine.test_oneshot import run
from tests.engine.tiny import hf_tiny_llama, tiny_engine

GEN = random.Random(0)


def make_request(rid: str, prompt_len: int, max_tokens: int, arrival: float, slo_ms: float | None = None) -> Request:
    """A Decode-class request (max_tokens >= 2; one token would make it OneShot)."""
    max_tokens = max(2, max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, ttft_slo_ms=slo_ms)
    rules = RequestRules(max_model_len=4096, vocab_size=100, eos_token_ids=frozenset())
    return validate_request(rid, [1 + (i % 50) for i in range(prompt_len)], params, rules, seed_source=GEN, arrival_time=arrival)


def make_scheduler(policy: str, *, num_blocks: int = 512, budget: int = 64, decode_batch: int | None = None,
                   options: PolicyConfig | None = None, prefix: bool = False) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64, max_model_len=4096,
                          max_decode_batch=decode_batch, policy=policy)
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=prefix)
    return Scheduler(cfg, kv, make_policy(policy, options), vocab_size=100, hidden_size=64)


def fake_execute(s: Scheduler, plan: ScheduleResult, finished: list[str]) -> None:
    """What the engine's postprocess does, minus the model: every sample is token 7."""
    rows = plan.batch.rows if plan.batch is not None else ()
    samples = {r.request_id for r in rows if r.sample is not None}
    for rid, n in plan.scheduled.items():
        req = next(r for r in s.admitted if r.request_id == rid)
        req.num_computed_tokens += n
        if rid in samples:
            req.output_token_ids.append(7)
            if len(req.output_token_ids) >= req.max_output_tokens:
                s.finish(req)
                finished.append(rid)
    s.kv.check_integrity()


def admitted_ids(plan: ScheduleResult) -> list[str]:
    return list(plan.scheduled)


def test_srpt_prefers_short_prompts_and_prevents_starvation() -> None:
    s = make_scheduler("srpt", budget=40, options=PolicyConfig(srpt_starvation_s=5.0))
    s.add(make_request("long", 40, 1, arrival=0.0))
    s.add(make_request("short", 8, 1, arrival=0.5))
    assert admitted_ids(s.schedule(now=1.0))[0] == "short"
    s2 = make_scheduler("srpt", budget=40, options=PolicyConfig(srpt_starvation_s=5.0))
    s2.add(make_request("long", 40, 1, arrival=0.0))
    s2.add(make_request("short", 8, 1, arrival=5.5))
    assert admitted_ids(s2.schedule(now=6.0))[0] == "long"  # waited past the limit: to the front


def test_fcfs_takes_arrival_order() -> None:
    s = make_scheduler("fcfs", budget=40)
    s.add(make_request("long", 40, 1, arrival=0.0))
    s.add(make_request("short", 8, 1, arrival=0.5))
    assert admitted_ids(s.schedule(now=1.0)) == ["long"]


def test_mlfq_demotes_after_quantum_and_promotes_starved() -> None:
    opts = PolicyConfig(mlfq_quanta=(2, 4, 8), mlfq_starvation_steps=3)
    s = make_scheduler("mlfq", decode_batch=1, options=opts)
    a, b = make_request("a", 4, 50, arrival=0.0), make_request("b", 4, 50, arrival=1.0)
    s.add(a)
    s.add(b)
    done: list[str] = []
    fake_execute(s, s.schedule(now=2.0), done)  # both prompts computed (prefill), first tokens sampled
    served = []
    for t in range(8):
        plan = s.schedule(now=3.0 + t)
        served.append([rid for rid, n in plan.scheduled.items()])
        fake_execute(s, plan, done)
    # a spends its level-0 quantum (2) and is demoted; b (level 0) takes the slot for its
    # quantum and is demoted too; both on level 1, a (older) runs; after 3 unserved steps
    # b is promoted back to level 0 and takes the slot.
    assert served == [["a"], ["a"], ["b"], ["b"], ["a"], ["a"], ["a"], ["b"]]
    assert (a.mlfq_level, a.mlfq_used, b.mlfq_level) == (1, 3, 0)
    # a request that is never served for 3 steps goes back to level 0
    c = make_request("c", 4, 50, arrival=0.0)
    c.mlfq_level, c.mlfq_used = 2, 1
    s.policy.decode.on_step([], [c], now=0.0)
    s.policy.decode.on_step([], [c], now=0.0)
    assert c.mlfq_level == 2
    s.policy.decode.on_step([], [c], now=0.0)
    assert (c.mlfq_level, c.mlfq_used) == (0, 0)


def test_awd_waits_grows_depth_and_dispatches_early_on_deadline() -> None:
    laps = LAPSPrefill(boundary=64, window_bounds_s=(0.01, 0.05), initial_depth=4)
    remaining = lambda r: r.num_prompt_tokens  # noqa: E731
    shorts = [make_request(f"s{i}", 10, 1, arrival=0.0) for i in range(2)]
    assert laps.plan(shorts, 0.005, remaining, 1024) == []  # below depth, window open: wait
    # the window closes: dispatch what is there, and aim lower next time
    batch = laps.plan(shorts, 0.02, remaining, 1024)
    assert [c.request.request_id for c in batch] == ["s0", "s1"] and laps.awd.depth == 2
    assert laps.dispatches[-1] == (2, "window")
    # depth reached quickly: dispatch at once, and grow the target depth
    quick = [make_request(f"q{i}", 12, 1, arrival=1.0) for i in range(2)]
    assert len(laps.plan(quick, 1.001, remaining, 1024)) == 2
    assert laps.dispatches[-1] == (2, "depth") and laps.awd.depth == 4
    # a lone short with a near TTFT deadline goes early
    urgent = [make_request("u", 10, 1, arrival=2.0, slo_ms=60)]
    laps.awd.service_s = 0.02  # the estimated short-prefill step time
    assert laps.plan(urgent, 2.0005, remaining, 1024) == []  # slack still large
    went = laps.plan(urgent, 2.0 + 0.06 - laps.awd.service_s - 0.005, remaining, 1024)
    assert [c.request.request_id for c in went] == ["u"] and laps.dispatches[-1][1] == "deadline"


def test_laps_separates_long_chunks_from_short_batches() -> None:
    s = make_scheduler("laps", budget=256, options=PolicyConfig(laps_boundary=32, laps_long_chunk=48))
    s.add(make_request("long", 200, 1, arrival=0.0))
    plan = s.schedule(now=0.0)
    assert plan.scheduled == {"long": 48}  # a fixed chunk, alone
    done: list[str] = []
    fake_execute(s, plan, done)
    for i in range(4):
        s.add(make_request(f"s{i}", 10, 1, arrival=0.001))
    plan = s.schedule(now=0.002)
    assert plan.scheduled == {"long": 48}  # shorts wait for their window/depth meanwhile
    fake_execute(s, plan, done)
    s.policy.prefill.awd.depth = 4
    plan = s.schedule(now=0.003)
    assert set(plan.scheduled) == {"s0", "s1", "s2", "s3"}  # a short-only step


def test_step_time_model_fits_the_boundary() -> None:
    model = StepTimeModel()
    a, b = 2e-7, 1e-4  # attention cost equals linear cost at L = b / a = 500
    rng = random.Random(0)
    for _ in range(40):
        rows = [(rng.randint(8, 1500), rng.randint(0, 300)) for _ in range(rng.randint(1, 3))]
        seconds = sum(a * L * (L + 2 * H) + b * L + 3e-6 * H for L, H in rows) + 0.002
        model.add(rows, seconds)
    assert model.boundary() == pytest.approx(500, rel=0.01)
    laps = LAPSPrefill(boundary=None)
    for _ in range(20):
        rows = [(rng.randint(8, 1500), 0) for _ in range(rng.randint(1, 3))]
        laps.observe_step(rows, sum(a * L * L + b * L for L, _ in rows) + 0.002)
    assert laps.boundary == pytest.approx(500, rel=0.05)


@pytest.mark.parametrize("policy", ["fcfs", "srpt", "mlfq", "laps", "srpt+mlfq", "laps+mlfq"])
def test_no_request_lost_or_duplicated_under_preemption(policy: str) -> None:
    rng = random.Random(1)
    s = make_scheduler(policy, num_blocks=40, budget=48, decode_batch=6,
                       options=PolicyConfig(laps_boundary=24, laps_long_chunk=32, mlfq_quanta=(3, 6, 12)))
    reqs = [make_request(f"r{i}", rng.randint(2, 70), rng.randint(1, 25), arrival=i * 0.01) for i in range(30)]
    pending = list(reqs)
    done: list[str] = []
    now = 0.0
    for _ in range(5000):
        while pending and pending[0].arrival_time <= now:
            s.add(pending.pop(0))
        fake_execute(s, s.schedule(now=now), done)
        now += 0.01
        if not pending and not s.has_work():
            break
    assert sorted(done) == sorted(r.request_id for r in reqs)  # each exactly once
    assert all(len(r.output_token_ids) == r.max_output_tokens for r in reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert s.kv.num_available_blocks == s.kv.pool.num_blocks


def test_greedy_outputs_identical_under_every_policy() -> None:
    hf = hf_tiny_llama()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (int(n),), generator=gen).tolist() for n in (5, 60, 12, 33, 3, 90)]
    reqs: list[Any] = [(str(i), p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), None)
                       for i, p in enumerate(prompts)]
    results = {}
    for policy in ("fcfs", "srpt", "mlfq", "laps", "srpt+mlfq"):
        engine = tiny_engine(hf, num_blocks=40, max_num_batched_tokens=32)
        engine.scheduler.policy = make_policy(policy, PolicyConfig(laps_boundary=16, laps_long_chunk=24,
                                                                   mlfq_quanta=(2, 4)))
        engine.scheduler.config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16, max_decode_batch=3,
                                                  max_model_len=engine.max_model_len, policy=policy)
        results[policy] = {rid: out.new_token_ids for rid, out in run(engine, reqs).items()}
    assert all(r == results["fcfs"] for r in results.values())


def test_laps_wait_depth_uses_the_given_bucket_list() -> None:
    from prelude.config import PolicyConfig
    from prelude.engine.policies import make_policy
    from prelude.engine.policies.laps import LAPSPrefill

    policy = make_policy("laps", PolicyConfig(depth_buckets=(3, 6, 12)))
    prefill = policy.prefill
    assert isinstance(prefill, LAPSPrefill)
    assert prefill.depth_buckets == (3, 6, 12)
    assert prefill.awd.depth == 6  # the initial depth (8) floored to a real bucket
