"""Gathering a burst of OneShot requests into one step instead of two.

Closed-loop clients (a judge at c=16) send their next requests as soon as their answers
arrive, so after a OneShot step of k rows, k requests come back within a round trip, one
by one over HTTP. The engine thread used to start a step with the first one or few of them
and run the rest in the next step: a split that the loop then repeats forever (the late
group's answers come back a step later again), paying a step's fixed costs twice and
running the HTTP work of the late arrivals on the cores the forward was using.

The rule: after a step with OneShot rows, expect as many OneShot requests as that step
finished plus those already waiting, and hold a OneShot-only step (no paged work in the
engine: nobody's next token waits on it) while fewer than that are waiting, for as long
as the burst keeps coming (no arrival gap above `GAP_S` or 2% of that step once one came)
and at most 5% of that step's duration (capped by `--oneshot-gather-ms`). A request that comes alone (c=1) finds the
count met at once and waits for nothing; open-loop arrivals wait at most that fraction.
Offline handovers (`LLM.generate`) turn it off: everything is handed over before the step.

A burst that no step announced (the first wave of a judge: c=16 requests sharing a cold
prefix, sent at once after a pause) reaches the engine one request at a time as the HTTP
thread parses them; a step started with the first few ran the rest a step later (the
1,024-token shared prefix's leader with 6 of its 15 peers, then the other 9). So while
nothing is expected: while OneShot requests wait, the step holds while they keep coming
(no gap above GAP_S or 2% of the step they would make: the front parses a burst's prompts
a few milliseconds apart) for at most 5% of that step (its prompt tokens,
at most a step's budget, at the last OneShot step's time per token) and the cap. A lone
request waits only with a prompt of LONE_MIN_TOKENS or more (a shared prefix that long
is worth its peers' company: the engine thread took the first request of such a wave
alone in about one wave of four), within the same bounds. A short lone request (c=1)
never waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from prelude.engine.request import Request

# Once the burst started, a quieter stretch than this ends it: GAP_S, or a fraction of the
# step on a machine so busy that the HTTP work of one request takes longer than GAP_S.
GAP_S = 0.005
GAP_FRACTION = 0.02
STEP_FRACTION = 0.05  # the longest hold, as a fraction of the last OneShot step's duration
LONE_MIN_TOKENS = 512  # a lone request with no burst announced waits for peers from this prompt length on


@dataclass
class BurstGather:
    max_wait_s: float  # the cap on a hold; 0: never hold
    expected: int = 0  # OneShot requests expected after the last OneShot step
    opened: float = 0.0  # when that step ended (monotonic)
    step_s: float = 0.0  # how long it took
    s_per_token: float = 0.0  # and per token it computed (0: not told)

    def observe(self, seconds: float, tokens: int = 0) -> None:
        """The duration of a step with OneShot rows and the prompt tokens it computed (told
        before `step_ended`)."""
        self.step_s = seconds
        if tokens > 0:
            self.s_per_token = seconds / tokens

    def step_ended(self, finished: int, waiting: int, now: float) -> None:
        self.expected = finished + waiting
        self.opened = now

    def hold(self, waiting: Sequence[Request], now: float, step_tokens: int | None = None) -> float:
        """How much longer a OneShot-only step with `waiting` should wait for more of its
        burst if nothing else arrives: seconds, 0.0 for not at all (the engine's loop naps
        no longer than that); `step_tokens`: the most prompt tokens a step takes (bounds its
        estimate)."""
        if self.max_wait_s <= 0:
            return 0.0
        limit = min(self.max_wait_s, STEP_FRACTION * self.step_s)  # 0 until a step was timed
        if self.expected > 0 and limit > 0 and 0 <= now - self.opened < limit:  # a burst announced
            if len(waiting) >= self.expected:
                return 0.0
            left = limit - (now - self.opened)
            newest = max((r.arrival_time for r in waiting), default=self.opened)
            if newest <= self.opened:  # before the first request of the burst is back: the round trip
                return left
            return max(0.0, min(left, max(GAP_S, GAP_FRACTION * self.step_s) - (now - newest)))
        return self._unannounced(waiting, now, step_tokens)

    def _unannounced(self, waiting: Sequence[Request], now: float, step_tokens: int | None) -> float:
        """A burst no step announced: the last request just in, and two or more waiting or a
        long one."""
        if not waiting or self.s_per_token <= 0:
            return 0.0
        if len(waiting) == 1 and waiting[0].num_prompt_tokens < LONE_MIN_TOKENS:
            return 0.0
        tokens = sum(r.num_prompt_tokens for r in waiting)  # an upper bound: cached prefixes count too
        step_s = self.s_per_token * (tokens if step_tokens is None else min(tokens, step_tokens))
        first = min(r.arrival_time for r in waiting)
        newest = max(r.arrival_time for r in waiting)
        return max(0.0, min(min(self.max_wait_s, STEP_FRACTION * step_s) - (now - first),
                            max(GAP_S, GAP_FRACTION * step_s) - (now - newest)))
