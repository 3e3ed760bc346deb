"""Whether the rest of the machine leaves this process's thread team its cores.

A team's parallel region joins only when every thread of it has run: where another process
(or a hypervisor's steal) holds a core, each join waits for the OS to schedule the missing
thread. step_threads.py splits a tiny model's steps over the team only while the machine is
quiet, and so asks this every step.

The measure is the CPU time that work outside the team used over the last window, in cores:
/proc/stat's busy ticks of all CPUs (steal included) less /proc/self/stat's user and system
ticks (other processes: a load generator, `--api-server-count`'s fronts, a neighbour), plus
this process's main thread when the team is not its (a server's HTTP event loop: the team's
spinning worker would take the core it parses, tokenizes and answers on). The main thread
counts at the lower of its share of the window and its share of the time steps ran
(`step_began` / `step_ended`: two reads of its CPU clock a step): one request at a time, the
event loop works between the steps, on the core the step leaves (128/1 at c=1: ~0.3 cores
over the window, ~0 while steps run), and at c=32 it parses and answers beside every step.
Quiet: at most the cores the team leaves free plus QUIET_SLACK_CORES; busy again past
BUSY_SLACK_CORES (in between the last answer stands, so one window's noise does not flip
it). Without /proc (not Linux) the machine never counts as quiet.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

WINDOW_S = 0.5  # the shortest window measured (a step asks more often: the answer is kept)
# A load generator's, a shell's or an event loop's share of a core below this still counts as
# quiet. Read on a 2-core machine with the free model (`prelude bench overhead`): 8-prompt
# requests at c=4 and 128/1 at c=1 stay below QUIET_SLACK_CORES, on one thread or on the
# team; OneShot, classify and embed at c=32 and c=64, whose event loop answers requests
# beside the steps, read above BUSY_SLACK_CORES (there the team loses: its spinning worker
# holds the core the event loop needs). The gap between the bounds is narrow: c=32 right
# after c=1 read just above BUSY_SLACK_CORES for a few windows, which a higher bound would
# have left on the team.
QUIET_SLACK_CORES = 0.3
BUSY_SLACK_CORES = 0.4


@dataclass(frozen=True)
class CpuSample:
    """Cumulative counters at one moment: all CPUs' busy ticks, this process's ticks, and
    the CPU seconds of this process's front (main) thread (0 where the team runs on it)."""

    at_s: float
    busy_ticks: int
    own_ticks: int
    front_s: float = 0.0


def others_cores(before: CpuSample, after: CpuSample, ticks_per_s: float,
                 front_in_steps: float | None = None) -> float:
    """Cores' worth of CPU time used outside the team between two samples: other processes
    and this process's front thread, the latter at most `front_in_steps` (its share of the
    time the team's steps ran; None: not measured)."""
    wall = after.at_s - before.at_s
    if wall <= 0 or ticks_per_s <= 0:
        return 0.0
    others = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
    front = max(0.0, after.front_s - before.front_s) / wall
    return max(0.0, others / ticks_per_s / wall) + (front if front_in_steps is None else min(front, front_in_steps))


def front_thread_seconds() -> float:
    """The CPU seconds of this process's main thread, when the caller is another thread (the
    engine's, beside a server's event loop); 0 when the caller is the main thread or the
    platform has no per-thread clocks."""
    main = threading.main_thread()
    if threading.get_ident() == main.ident or main.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(main.ident))
    except OSError:
        return 0.0


def read_sample(at_s: float, proc: Path = Path("/proc"),
                front: Callable[[], float] = front_thread_seconds) -> CpuSample | None:
    """The counters now (None where /proc cannot be read). /proc/stat's first line is `cpu
    user nice system idle iowait irq softirq steal ...`; /proc/self/stat has utime and stime
    as its 14th and 15th fields (the 12th and 13th after the command's closing parenthesis)."""
    try:
        first = (proc / "stat").read_text().split("\n", 1)[0].split()
        own = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu" or len(first) < 9 or len(own) < 13:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    return CpuSample(at_s, user + nice + system + irq + softirq + steal, int(own[11]) + int(own[12]), front())


class SpareCores:
    """`quiet()`: whether the machine leaves a team of `team` threads its cores, as last
    measured over at least WINDOW_S. `step_began()` and `step_ended()` bracket each step
    (on the engine thread); `front` reads the main thread's CPU seconds."""

    def __init__(self, team: int, cores: int | None = None,
                 read: Callable[[float], CpuSample | None] = read_sample,
                 clock: Callable[[], float] = time.monotonic, ticks_per_s: float | None = None,
                 front: Callable[[], float] = front_thread_seconds) -> None:
        if cores is None:
            affinity = getattr(os, "sched_getaffinity", None)
            cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
        self.free_cores = max(0, cores - team)
        self._read = read
        self._clock = clock
        if ticks_per_s is None:
            ticks_per_s = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._ticks_per_s = ticks_per_s
        self._readable = True  # until a read fails (no /proc: never quiet)
        # The first window starts at the first ask, on the asking (engine) thread: from the
        # constructing thread the front's clock would read 0, then its whole CPU time so far.
        self._last: CpuSample | None = None
        self._quiet = False
        self.others = 0.0  # the last window's measure, in cores
        self._front = front
        self._step: tuple[float, float] | None = None  # the step running: (wall, front CPU) at its start
        self._front_in_steps = 0.0  # this window's steps: the main thread's CPU seconds meanwhile
        self._wall_in_steps = 0.0  # and their wall seconds

    def step_began(self) -> None:
        self._step = (self._clock(), self._front())

    def step_ended(self) -> None:
        if self._step is None:
            return
        (began, front), self._step = self._step, None
        self._wall_in_steps += max(0.0, self._clock() - began)
        self._front_in_steps += max(0.0, self._front() - front)

    def _take_front_in_steps(self) -> float | None:
        """The main thread's share of the time this window's steps ran (None: no step ran);
        the next window starts from nothing."""
        share = self._front_in_steps / self._wall_in_steps if self._wall_in_steps > 0 else None
        self._front_in_steps = self._wall_in_steps = 0.0
        return share

    def quiet(self) -> bool:
        if not self._readable:
            return False
        now = self._clock()
        if self._last is not None and now - self._last.at_s < WINDOW_S:
            return self._quiet
        sample = self._read(now)
        if sample is None:
            self._readable, self._quiet = False, False
            return False
        in_steps = self._take_front_in_steps()
        if self._last is None:  # steps before the first window are in none
            self._last = sample
            return False
        self.others = others_cores(self._last, sample, self._ticks_per_s, in_steps)
        self._last = sample
        if self.others <= self.free_cores + QUIET_SLACK_CORES:
            self._quiet = True
        elif self.others > self.free_cores + BUSY_SLACK_CORES:
            self._quiet = False
        return self._quiet
