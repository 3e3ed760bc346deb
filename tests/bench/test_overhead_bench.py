"""`prelude bench overhead`: medians over rounds, the goals against vLLM, the loadgen's job."""

from __future__ import annotations

import math
import os
import time

import pytest

from prelude.bench.overhead_bench import _median_points, goals
from prelude.bench.overhead_loadgen import load_spec, sender_for


def test_median_points_take_each_metric_over_rounds() -> None:
    rounds = [{"c1": {"kind": "completion", "e2e_p50_ms": 3.0, "req_s": 10.0}},
              {"c1": {"kind": "completion", "e2e_p50_ms": 1.0, "req_s": 30.0}},
              {"c1": {"kind": "completion", "e2e_p50_ms": 2.0, "req_s": 20.0}}]
    point = _median_points(rounds)["c1"]
    assert point == {"kind": "completion", "rounds": 3, "e2e_p50_ms": 2.0, "req_s": 20.0}


def test_goals_compare_prelude_with_vllm_in_the_right_direction() -> None:
    pre = {"c1": {"e2e_p50_ms": 2.5}, "oneshot_c32": {"req_s": 500.0}, "decode_c8": {"tpot_p50_ms": 2.0},
           "multi_c4": {"items_s": 1000.0}}
    vllm = {"c1": {"e2e_p50_ms": 12.5}, "oneshot_c32": {"req_s": 200.0}, "decode_c8": {"tpot_p50_ms": 3.0},
            "multi_c4": {"items_s": 500.0}}
    rows = {r["goal"]: r for r in goals({"prelude": pre, "vllm": vllm})}
    assert rows["128/1 c=1 E2E p50 <= 2.0 ms"]["met"] is False
    assert rows["128/1 c=1 E2E p50: vllm / prelude >= 4"]["value"] == 5.0
    assert rows["128/1 c=32 req/s: prelude / vllm >= 2"]["met"] is True
    assert math.isclose(rows["decode 16/64 c=8 TPOT p50: vllm / prelude >= 2"]["value"], 1.5)
    assert rows["decode 16/64 c=8 TPOT p50: vllm / prelude >= 2"]["met"] is False
    assert rows["8-prompt requests prompts/s: prelude / vllm >= 2.5"]["met"] is False


def test_goals_without_vllm_are_open() -> None:
    rows = goals({"prelude": {"c1": {"e2e_p50_ms": 1.5}}})
    assert rows[0]["met"] is True
    assert all(r["met"] is None for r in rows[1:])


def test_a_job_becomes_its_closed_loop() -> None:
    job = {"concurrency": 8, "warmup": ["a", "b"], "warmup_s": 1.5, "seed": 3}
    spec = load_spec(job)
    assert (spec.concurrency, spec.rate, spec.warmup, spec.warmup_s, spec.seed) == (8, None, 2, 1.5, 3)
    assert load_spec({"concurrency": 1}).warmup_s == 0.0


def test_loadgen_refuses_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        sender_for({"base": "http://x", "kind": "nope"})


def test_main_thread_cpu_is_a_part_of_the_process_cpu() -> None:
    import os
    import threading
    import time

    from prelude.bench.server_proc import cpu_seconds, main_thread_cpu_seconds

    def spin() -> None:  # until this thread itself has used 0.1 s of CPU, however busy the machine
        while time.thread_time() < 0.1:
            pass

    main0, all0 = main_thread_cpu_seconds(os.getpid()), cpu_seconds(os.getpid())
    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    main1, all1 = main_thread_cpu_seconds(os.getpid()), cpu_seconds(os.getpid())
    # The worker's CPU counts for the process, not for the main thread that only waited.
    assert all1 - all0 >= 0.08
    assert main1 - main0 < all1 - all0
    assert main_thread_cpu_seconds(-1) == 0.0  # no such process: nothing, not an error


def test_wait_until_idle_returns_once_the_servers_are_idle() -> None:
    """The settle step before a peer's measured load: an idle process (asleep) ends the
    wait at its first window, far inside the limit; no process, no wait."""
    import subprocess
    import sys

    from prelude.bench.server_proc import wait_until_idle

    assert wait_until_idle([]) == 0.0
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # past the interpreter's start-up CPU
        assert wait_until_idle([idle.pid], window_s=0.1, limit_s=60.0) < 30.0
    finally:
        idle.kill()
        idle.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_for_state(pid: int, stopped: bool) -> bool:
    deadline = time.monotonic() + 30.0  # signals land at once; the bound only guards a hang
    while time.monotonic() < deadline:
        if (_state(pid) == "T") == stopped:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux /proc")
def test_frozen_stops_a_server_and_its_children_for_the_block_only() -> None:
    """bench serve measures each server alone: the others (and their child processes, as
    vLLM's engine core is) are stopped for the measured load and resumed after."""
    import subprocess
    import sys

    from prelude.bench.server_proc import frozen, process_tree

    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                               "'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "up"
        tree = process_tree(parent.pid)
        assert len(tree) == 2 and tree[0] == parent.pid
        with frozen([parent.pid, 0]):  # 0: a peer without a process is skipped
            assert all(_wait_for_state(p, stopped=True) for p in tree)
        assert all(_wait_for_state(p, stopped=False) for p in tree)
    finally:
        for p in reversed(process_tree(parent.pid)):
            os.kill(p, 9)
        parent.wait()
