"""Low-priority requests (a /v1/batches job's lines) yield to normal ones in the
scheduler's plan: normal work is admitted first, low-priority prompt work gets nothing
while a normal prompt waits or right after a normal step (the client's next request is
on its way), at most `low_priority_step_tokens` a step while normal requests are about,
and full steps alone (fake clock, no model)."""

from __future__ import annotations

import random

from prelude import SamplingParams
from prelude.config import SchedulerConfig
from prelude.engine.policies import make_policy
from prelude.engine.request import ExecClass, Request
from prelude.engine.scheduler import ScheduleResult, Scheduler
from prelude.engine.validation import RequestRules, validate_request
from prelude.kv.kv_manager import KVCacheManager

GEN = random.Random(0)
CAP = 16  # low_priority_step_tokens of these tests
LINGER = 0.5
RETURN = 0.05


def make_request(rid: str, prompt_len: int, max_tokens: int, arrival: float, low_priority: bool = False) -> Request:
    """max_tokens 1: a OneShot request (a judge line); more: a paged one."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, low_priority=low_priority)
    rules = RequestRules(max_model_len=4096, vocab_size=100, eos_token_ids=frozenset())
    tokens = [1 + (sum(map(ord, rid)) + i) % 50 for i in range(prompt_len)]
    return validate_request(rid, tokens, params, rules, seed_source=GEN, arrival_time=arrival)


def make_scheduler(policy: str = "fcfs", budget: int = 64, cap: int | None = CAP) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64, max_model_len=4096, policy=policy,
                          low_priority_step_tokens=cap, normal_linger_s=LINGER, normal_return_s=RETURN,
                          oneshot_gather_ms=0)
    return Scheduler(cfg, KVCacheManager(512, 4, enable_prefix_caching=False), make_policy(policy, None),
                     vocab_size=100, hidden_size=64)


def oneshot_ids(plan: ScheduleResult) -> list[str]:
    return [r.request_id for r in plan.oneshot_rows]


def test_a_normal_oneshot_goes_first_and_alone_then_low_priority_is_bounded_then_free() -> None:
    s = make_scheduler()
    for i in range(4):  # judge lines queued first
        s.add(make_request(f"b{i}", 10, 1, arrival=0.0, low_priority=True))
    s.add(make_request("user", 30, 1, arrival=1.0))
    assert all(r.exec_class is ExecClass.ONESHOT for r in s.oneshot_waiting)

    plan = s.schedule(now=1.0)  # a normal prompt waits: the low-priority lines get nothing
    assert oneshot_ids(plan) == ["user"]
    s.end_step(plan, ok=True, now=1.1)

    assert s.schedule(now=1.1 + RETURN / 2).batch is None  # the user's next request may be on its way

    plan = s.schedule(now=1.1 + RETURN)  # it did not come: at most CAP tokens of judge lines
    assert oneshot_ids(plan) == ["b0"]
    assert sum(len(r.token_ids) - r.num_cached for r in plan.oneshot_rows) <= CAP
    s.end_step(plan, ok=True, now=1.2)

    plan = s.schedule(now=1.0 + LINGER + 0.1)  # nobody else for a while: a full step
    assert oneshot_ids(plan) == ["b1", "b2", "b3"]


def test_without_normal_traffic_low_priority_runs_as_any_request() -> None:
    plans = []
    for low in (False, True):
        s = make_scheduler()
        for i in range(5):
            s.add(make_request(f"r{i}", 12, 1, arrival=0.0, low_priority=low))
        plans.append(oneshot_ids(s.schedule(now=1.0)))
    assert plans[0] == plans[1] == ["r0", "r1", "r2", "r3", "r4"]


def test_a_normal_paged_prompt_is_admitted_before_earlier_low_priority_work() -> None:
    s = make_scheduler(budget=64)
    s.add(make_request("batch", 40, 4, arrival=0.0, low_priority=True))
    s.add(make_request("user", 20, 4, arrival=1.0))
    plan = s.schedule(now=1.0)  # fcfs would take "batch" first; the normal prompt goes, alone
    assert plan.scheduled == {"user": 20}
    s.end_step(plan, ok=True, now=1.05)
    s.admitted[0].output_token_ids.append(7)  # the user's first token: it decodes now

    plan = s.schedule(now=1.05 + RETURN)  # the user decodes: the low-priority prompt gets a CAP-token chunk
    assert plan.scheduled == {"user": 1, "batch": CAP}


def test_a_low_priority_oneshot_over_the_bound_may_go_alone_when_no_normal_prompt_waits() -> None:
    """A long shared prefix (over the bound) still progresses while normal requests decode,
    one at a time, never beside another low-priority row."""
    s = make_scheduler(budget=128)
    s.add(make_request("user", 8, 50, arrival=0.0))
    plan = s.schedule(now=0.0)
    s.end_step(plan, ok=True, now=0.1)
    s.admitted[0].output_token_ids.append(7)
    s.add(make_request("rubric", 3 * CAP, 1, arrival=0.1, low_priority=True))
    s.add(make_request("item", 4, 1, arrival=0.1, low_priority=True))
    plan = s.schedule(now=0.1 + RETURN)
    assert plan.scheduled == {"user": 1} and oneshot_ids(plan) == ["rubric"]


def test_no_bound_configured_orders_normal_first_only() -> None:
    s = make_scheduler(cap=None)
    for i in range(3):
        s.add(make_request(f"b{i}", 10, 1, arrival=0.0, low_priority=True))
    s.add(make_request("user", 10, 1, arrival=1.0))
    assert oneshot_ids(s.schedule(now=1.0)) == ["user", "b0", "b1", "b2"]
