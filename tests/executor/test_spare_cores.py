"""The machine's load as step_threads.py reads it: others' CPU time, in cores, per window."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from prelude.executor.spare_cores import (WINDOW_S, CpuSample, SpareCores, front_thread_seconds, others_cores,
                                          read_sample)

_QUIET = SpareCores.quiet  # the real one (the suite's autouse fixture stubs it out per test)


def test_others_are_all_cpus_busy_time_less_this_process() -> None:
    a, b = CpuSample(10.0, 1_000, 400), CpuSample(12.0, 1_300, 500)  # 2 s, 300 busy ticks, 100 ours
    assert others_cores(a, b, ticks_per_s=100.0) == pytest.approx(1.0)
    assert others_cores(a, CpuSample(12.0, 1_050, 500), 100.0) == 0.0  # counters' skew never goes negative
    assert others_cores(a, a, 100.0) == 0.0


def test_the_front_threads_cpu_time_counts_as_others_work() -> None:
    """This process's main thread (a server's event loop) takes the core the team would use:
    its CPU seconds are added though /proc counts them as this process's."""
    a, b = CpuSample(10.0, 1_000, 400, front_s=3.0), CpuSample(12.0, 1_300, 500, front_s=4.2)
    assert others_cores(a, b, ticks_per_s=100.0) == pytest.approx(1.0 + 0.6)


def test_the_front_thread_counts_at_most_its_share_of_the_steps_time() -> None:
    """One request at a time the event loop works between steps, not beside them: its 0.6
    cores over the window count as its share of the steps' time when that is lower."""
    a, b = CpuSample(10.0, 1_000, 400, front_s=3.0), CpuSample(12.0, 1_300, 500, front_s=4.2)
    assert others_cores(a, b, 100.0, front_in_steps=0.05) == pytest.approx(1.0 + 0.05)
    assert others_cores(a, b, 100.0, front_in_steps=0.9) == pytest.approx(1.0 + 0.6)
    assert others_cores(a, b, 100.0, front_in_steps=None) == pytest.approx(1.0 + 0.6)  # no step measured


def test_front_thread_seconds_reads_the_main_thread_from_another_thread() -> None:
    """From the main thread it is 0 (the team runs there: nothing beside it); from another
    thread it follows the main thread's CPU time, which grows while the main thread works."""
    assert front_thread_seconds() == 0.0
    if not hasattr(time, "pthread_getcpuclockid"):
        pytest.skip("no per-thread CPU clocks on this platform")
    reads: list[float] = []
    go, done = threading.Event(), threading.Event()

    def engine() -> None:
        reads.append(front_thread_seconds())
        go.set()
        done.wait()
        reads.append(front_thread_seconds())

    worker = threading.Thread(target=engine)
    worker.start()
    go.wait()
    start = time.thread_time()
    while time.thread_time() - start < 0.05:  # 50 ms of the main thread's CPU, however long that takes
        pass
    done.set()
    worker.join()
    assert reads[0] > 0.0 and reads[1] - reads[0] >= 0.05


def test_read_sample_parses_proc_stat_and_the_process_line(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "stat").write_text("cpu  10 2 3 100 5 1 1 4 0 0\ncpu0 5 1 1 50 2 0 0 2 0 0\n")
    # the command may hold spaces and parentheses: fields are read after the last ")"
    (tmp_path / "self" / "stat").write_text("77 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 30 12 0 0 20 0\n")
    sample = read_sample(3.5, tmp_path, front=lambda: 2.5)
    assert sample == CpuSample(3.5, 10 + 2 + 3 + 1 + 1 + 4, 30 + 12, 2.5)  # idle and iowait left out
    assert read_sample(0.0, tmp_path / "missing") is None
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert read_sample(0.0, tmp_path) is None


class _Machine:
    """A fake clock and counters: `others` cores of someone else's work a second, and this
    process's front (main) thread's CPU seconds."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.reads, self.front_s = 0.0, 0, 0, 0, 0.0

    def run(self, seconds: float, others: float, ours: float = 1.0, front: float = 0.0) -> None:
        self.now += seconds
        self.busy += 100 * seconds * (others + ours + front)
        self.own += 100 * seconds * (ours + front)
        self.front_s += seconds * front

    def read(self, at: float) -> CpuSample:
        self.reads += 1
        return CpuSample(at, round(self.busy), round(self.own), self.front_s)

    def probe(self, team: int = 2, cores: int = 2) -> SpareCores:
        return SpareCores(team=team, cores=cores, read=self.read, clock=lambda: self.now, ticks_per_s=100.0,
                          front=lambda: self.front_s)


def test_quiet_follows_others_use_with_hysteresis() -> None:
    m = _Machine()
    probe = m.probe()
    m.run(5.0, others=0.0)  # before the first ask: not part of any window
    assert _QUIET(probe) is False  # the first ask starts the first window
    m.run(WINDOW_S / 2, others=2.0)
    assert _QUIET(probe) is False  # inside it: no answer yet
    m.run(WINDOW_S, others=0.1)
    # the window is the 0.75 s since the first ask, (2.0 x 0.25 + 0.1 x 0.5) / 0.75 = 0.73
    # cores: busy (from construction on, the quiet 5 s would have made it 0.10)
    assert _QUIET(probe) is False and probe.others == pytest.approx(0.55 / 0.75)
    m.run(1.0, others=0.1)
    assert _QUIET(probe) is True and probe.others == pytest.approx(0.1)
    m.run(1.0, others=0.35)  # between the bounds: the last answer stands
    assert _QUIET(probe) is True
    m.run(1.0, others=1.0)  # a busy-looping neighbour
    assert _QUIET(probe) is False
    m.run(1.0, others=0.35)
    assert _QUIET(probe) is False
    m.run(1.0, others=0.2)
    reads = m.reads
    assert _QUIET(probe) is True
    m.run(WINDOW_S / 2, others=2.0)  # inside the window: no read, the answer kept
    assert _QUIET(probe) is True and m.reads == reads + 1


def test_cores_the_team_leaves_free_absorb_others_work() -> None:
    m = _Machine()
    probe = m.probe(team=2, cores=4)
    assert _QUIET(probe) is False  # the first ask starts the first window
    m.run(1.0, others=2.25)
    assert _QUIET(probe) is True
    m.run(1.0, others=2.5)
    assert _QUIET(probe) is False


def test_an_event_loop_that_works_between_the_steps_leaves_the_machine_quiet() -> None:
    """c=1: the front thread works 0.4 cores' worth, all of it between the steps, so the
    machine is quiet; at c=32 it works beside the steps and the machine is busy. Steps
    before the first window are in none."""
    m = _Machine()
    probe = m.probe()
    probe.step_began()
    m.run(2.0, others=0.0, front=1.0)  # a long step beside a busy front, before the first ask
    probe.step_ended()
    assert _QUIET(probe) is False  # the first ask starts the first window
    for _ in range(100):  # 1 s: 6 ms steps, the front's 4 ms between them
        probe.step_began()
        m.run(0.006, others=0.05)
        probe.step_ended()
        m.run(0.004, others=0.05, ours=0.0, front=1.0)
    assert _QUIET(probe) is True and probe.others == pytest.approx(0.05, abs=0.02)
    for _ in range(100):  # the front now works beside the steps
        probe.step_began()
        m.run(0.01, others=0.05, front=0.6)
        probe.step_ended()
    assert _QUIET(probe) is False and probe.others == pytest.approx(0.65, abs=0.02)


def test_without_proc_the_machine_is_never_quiet() -> None:
    probe = SpareCores(team=2, cores=2, read=lambda at: None, clock=lambda: 100.0)
    assert _QUIET(probe) is False
