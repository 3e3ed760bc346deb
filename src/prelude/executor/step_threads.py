"""How many CPU threads a step's trunk and its heads run on: one for work too small to split.

Every torch op of a forward is a parallel region of the OpenMP team: the team wakes,
splits the op and joins. On a step whose whole work is ~0.1 GFLOP (a 128-token prompt
through a 2-layer toy model, a decode row of a tiny model) those joins are the step, and
on a busy machine a join waits for a team thread the OS has not scheduled yet: a free
model's 128-token forward took 40-65 ms on two threads at load average 8, 0.9-1.8 ms on
one (bench overhead). After a region the team's threads also spin for a while before
they sleep, on the core the server's HTTP thread needs.

The trunk (the decoder's layers) and the heads (LM head, sampling) are decided apart: a
tiny model with a large vocabulary has a trunk of a few hundred microseconds even when
its step samples 8-16 rows through a 49,152-row head. Splitting that trunk only buys
joins, and the head of a few rows is a read of its weights that a second thread barely
shortens (8 rows of the free model's head: 1.0 ms on one thread, 0.8 on two, quiet).
So the trunk runs on one thread below SMALL_STEP_FLOPS, and the heads too while the
trunk is small and the sampled rows' head work is below SMALL_HEAD_FLOPS (decode of the
free model at c=8: both on one thread; at c=64 the head keeps the team). A model whose
one decode row is above SMALL_STEP_FLOPS (the default model: ~0.2 GFLOP a token) keeps
the whole team for everything, as before. Setting the count costs ~0.2 µs and applies
to the calling (engine) thread's team; on CUDA this does nothing.

A model below TINY_MODEL_FLOPS a token (the free model of `bench overhead`: ~0.6 MFLOP)
runs every step on one thread, batched OneShot prompts and wide decode heads included.
Its steps are never long enough to pay for the team when the server is busy: the other
core is what the HTTP thread (and, in the benchmark, the client) runs on. Measured, the
free model at load average ~5, alternated (server CPU per request, all threads): 128/1
c=32 6.3 -> 1.5 ms (98 -> 145 req/s), 8-prompt requests 34 -> 6.5 ms (132 -> 726
prompts/s); idle, the team's worker spun 0.74 ms a c=32 request.

What a quiet machine loses that way: a tiny model's large steps split well there (the free
model's 16 x 128-token OneShot steps ran ~1.3-1.45x faster on two threads in-process),
while beside three busy processes two threads halved the served figures. So a tiny
model's step of at least TINY_TEAM_MIN_FLOPS (trunk and heads) runs the way measured
faster on this machine lately (TeamTrial): one thread first, then the team, then the
faster of the two, with every TRIAL_EVERY-th such step run the other way so that a change
of load is noticed. Served 8-prompt requests, 3 runs alternated against one thread
always: 1,686-1,754 vs 1,560-1,610 prompts/s quiet; beside three busy processes 715-766
vs 715-752 (the trial settles on one thread).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

import torch

# Below this estimate of a trunk's multiply-adds x 2 it runs on one thread: a few hundred
# microseconds of work, where splitting saves less than the joins cost.
SMALL_STEP_FLOPS = 1e8
# The heads of a step with a small trunk stay on one thread below this (the LM head's
# multiply-adds x 2 over the sampled rows): ~16 rows of a hidden-128, 49,152-row head.
SMALL_HEAD_FLOPS = 2e8
# A model below this a token (2 x its weights a token passes through) is tiny: its steps
# run on one thread, but for the large ones TeamTrial decides. The free model is ~0.6 MFLOP a token, SmolLM2-135M ~0.2 GFLOP.
TINY_MODEL_FLOPS = 5e6
# A tiny model's step with at least this much work (trunk and heads: ~850 tokens of the free
# model, ~2.5 ms on one thread) runs the way TeamTrial measured faster; smaller ones stay on
# one thread, whose few milliseconds a join on a busy machine could double.
TINY_TEAM_MIN_FLOPS = 5e8
# Every so many such steps run the way not chosen: one in 32 costs ~0.5% on a quiet machine
# (the team ~15% faster) and ~3% on a busy one (the team ~2x slower).
TRIAL_EVERY = 32
TRIAL_WARMUP = 2  # steps each way before the faster is chosen (the first may fault pages in)

logger = logging.getLogger("prelude.executor.step_threads")


class TeamTrial:
    """Whether a tiny model's large steps run faster on one thread or on the team, on this
    machine under its current load: seconds per FLOP of each, a moving average (`weight` to
    the newest step). After TRIAL_WARMUP steps each way (one thread first) the faster way
    runs, and every `every`-th step the other, so the average of the way not chosen stays
    current when a neighbour starts or stops."""

    def __init__(self, every: int = TRIAL_EVERY, warmup: int = TRIAL_WARMUP, weight: float = 0.25) -> None:
        self.every, self.warmup, self.weight = every, warmup, weight
        self.seconds_per_flop: dict[bool, float] = {}  # team? -> the moving average
        self.samples = {False: 0, True: 0}
        self._steps = 0
        self._faster: bool | None = None

    def choose(self) -> bool:
        """Whether the next large step runs on the team."""
        self._steps += 1
        for team in (False, True):
            if self.samples[team] < self.warmup:
                return team
        faster = self.seconds_per_flop[True] < self.seconds_per_flop[False]
        if faster != self._faster:
            logger.info("a tiny model's large steps run %s: %.2f vs %.2f ms a GFLOP measured lately",
                        "on the team" if faster else "on one thread", 1e12 * self.seconds_per_flop[faster],
                        1e12 * self.seconds_per_flop[not faster])
            self._faster = faster
        return faster != (self._steps % self.every == 0)

    def record(self, team: bool, seconds: float, flops: float) -> None:
        rate = seconds / flops
        old = self.seconds_per_flop.get(team)
        self.seconds_per_flop[team] = rate if old is None else old + self.weight * (rate - old)
        self.samples[team] += 1


@dataclass(frozen=True)
class TrialStep:
    """A step TeamTrial chose for: run on the team or not, and its work estimate."""

    team: bool
    flops: float


class StepThreads:
    """`flops_per_token`: 2 x the weights a token passes through (embeddings left out);
    `flops_per_logit_row`: 2 x the LM head's weights (one per sampled row)."""

    def __init__(self, device: torch.device, flops_per_token: float, flops_per_logit_row: float) -> None:
        # A config the estimate cannot read (0 flops) never counts as small.
        self.enabled = device.type == "cpu" and torch.get_num_threads() > 1 and flops_per_token > 0
        self.flops_per_token = flops_per_token
        self.flops_per_logit_row = flops_per_logit_row
        self.trial = TeamTrial() if self.enabled and self.tiny_model else None

    @property
    def tiny_model(self) -> bool:
        return self.flops_per_token < TINY_MODEL_FLOPS

    def trunk_is_small(self, tokens: int) -> bool:
        return self.tiny_model or tokens * self.flops_per_token < SMALL_STEP_FLOPS

    def heads_are_small(self, tokens: int, logit_rows: int) -> bool:
        return self.tiny_model or (self.trunk_is_small(tokens)
                                   and logit_rows * self.flops_per_logit_row < SMALL_HEAD_FLOPS)

    def trial_step(self, tokens: int, logit_rows: int) -> TrialStep | None:
        """For a tiny model's step of at least TINY_TEAM_MIN_FLOPS: TeamTrial's choice
        (report the step's time to `finished`); None for every other step."""
        if self.trial is None:
            return None
        flops = tokens * self.flops_per_token + logit_rows * self.flops_per_logit_row
        return TrialStep(self.trial.choose(), flops) if flops >= TINY_TEAM_MIN_FLOPS else None

    def finished(self, step: TrialStep | None, seconds: float) -> None:
        if step is not None and self.trial is not None:
            self.trial.record(step.team, seconds, step.flops)

    def for_trunk(self, tokens: int, trial: TrialStep | None = None) -> contextlib.AbstractContextManager[None]:
        return self._one_thread(not trial.team if trial else self.trunk_is_small(tokens))

    def for_heads(self, tokens: int, logit_rows: int,
                  trial: TrialStep | None = None) -> contextlib.AbstractContextManager[None]:
        return self._one_thread(not trial.team if trial else self.heads_are_small(tokens, logit_rows))

    @contextlib.contextmanager
    def _one_thread(self, small: bool) -> Iterator[None]:
        if not self.enabled or not small:
            yield
            return
        team = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(team)


def decoder_flops(cfg: object) -> tuple[float, float]:
    """(flops per token, flops per logit row) of a decoder config (HF field names)."""
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(cfg, "head_dim", 0) or (hidden // heads if heads else 0))
    ffn = int(getattr(cfg, "intermediate_size", 0) or 0)
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o, k, v
    per_token = 2.0 * layers * (attn + 3 * hidden * ffn)
    return per_token, 2.0 * hidden * int(getattr(cfg, "vocab_size", 0) or 0)
