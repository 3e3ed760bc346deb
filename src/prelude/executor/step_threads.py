"""How many CPU threads a step's trunk and its heads run on: one for work too small to split.

Every torch op of a forward is a parallel region of the OpenMP team: the team wakes,
splits the op and joins. On a step whose whole work is ~0.1 GFLOP (a 128-token prompt
through a 2-layer toy model, a decode row of a tiny model) those joins are the step, and
on a busy machine a join waits for a team thread the OS has not scheduled yet: a free
model's 128-token forward then takes many times longer on two threads than on one (`prelude
bench overhead`). After a region the team's threads also spin for a while before
they sleep, on the core the server's HTTP thread needs.

The trunk (the decoder's layers) and the heads (LM head, sampling) are decided apart. A
model that is not tiny (below) runs its trunk on one thread below SMALL_STEP_FLOPS, and
its heads too while the trunk is small and the sampled rows' head work is below
SMALL_HEAD_FLOPS; a model whose one decode row is above SMALL_STEP_FLOPS (the default
model: ~0.2 GFLOP a token) keeps the whole team for everything. Setting the count is cheap
and applies to the calling (engine) thread's team; on CUDA this does nothing.

A model below TINY_MODEL_FLOPS a token (the free model of `bench overhead`: ~0.6 MFLOP)
runs every step on one thread, batched OneShot prompts and wide decode heads included,
while work outside the team holds the machine's cores (spare_cores.py: other processes,
and the server's own HTTP event loop beside the steps): a join then waits for a team
thread the OS has not scheduled, or the team's spinning worker takes the event loop's
core. On a loaded machine one thread cut the free model's server CPU per request several
times over and raised its throughput; beside one busy-looping process the team lost to one
thread as well. With the machine otherwise alone, the team gained on 8-prompt requests
and lost on OneShot and classify at c=32 and c=64 (its worker spins on the core the event
loop answers requests on, beside the steps).
So a tiny model's steps take the team only while the event loop and everything else leave
the second core quiet, which the 8-prompt requests and one request at a time do and c=32
does not; then every step does, small ones included (the size bounds were set on a busy
machine): 128/1 at c=1 is faster with trunk and head on the team, in process and served.
The figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch

from prelude.executor.spare_cores import SpareCores

# Below this estimate of a trunk's multiply-adds x 2 it runs on one thread: a few hundred
# microseconds of work, where splitting saves less than the joins cost.
SMALL_STEP_FLOPS = 1e8
# The heads of a step with a small trunk stay on one thread below this (the LM head's
# multiply-adds x 2 over the sampled rows): ~16 rows of a hidden-128, 49,152-row head.
SMALL_HEAD_FLOPS = 2e8
# A model below this a token (2 x its weights a token passes through) is tiny: all its
# steps run on one thread. The free model is ~0.6 MFLOP a token, SmolLM2-135M ~0.2 GFLOP.
TINY_MODEL_FLOPS = 5e6


class QuietProbe(Protocol):
    def quiet(self) -> bool: ...

    def step_began(self) -> None: ...

    def step_ended(self) -> None: ...


class StepThreads:
    """`flops_per_token`: 2 x the weights a token passes through (embeddings left out);
    `flops_per_logit_row`: 2 x the LM head's weights (one per sampled row); `spare`: whether
    the machine is quiet (a tiny model's only; spare_cores.SpareCores by default)."""

    def __init__(self, device: torch.device, flops_per_token: float, flops_per_logit_row: float,
                 spare: QuietProbe | None = None) -> None:
        # A config the estimate cannot read (0 flops) never counts as small.
        self.enabled = device.type == "cpu" and torch.get_num_threads() > 1 and flops_per_token > 0
        self.flops_per_token = flops_per_token
        self.flops_per_logit_row = flops_per_logit_row
        if spare is None and self.enabled and self.tiny_model:
            spare = SpareCores(torch.get_num_threads())
        self.spare = spare

    @property
    def tiny_model(self) -> bool:
        return self.flops_per_token < TINY_MODEL_FLOPS

    def _tiny_alone(self) -> bool:
        """A tiny model's step on one thread: unless the machine is quiet."""
        return not (self.spare is not None and self.spare.quiet())

    def _trunk_below_bound(self, tokens: int) -> bool:
        return tokens * self.flops_per_token < SMALL_STEP_FLOPS

    def trunk_is_small(self, tokens: int) -> bool:
        return self._tiny_alone() if self.tiny_model else self._trunk_below_bound(tokens)

    def heads_are_small(self, tokens: int, logit_rows: int) -> bool:
        if self.tiny_model:
            return self._tiny_alone()
        return self._trunk_below_bound(tokens) and logit_rows * self.flops_per_logit_row < SMALL_HEAD_FLOPS

    @contextlib.contextmanager
    def measured_step(self) -> Iterator[None]:
        """Brackets one step (its trunk and heads) for the quiet probe, which counts the
        server's event loop only while steps run (spare_cores.py)."""
        if self.spare is None:
            yield
            return
        self.spare.step_began()
        try:
            yield
        finally:
            self.spare.step_ended()

    def for_trunk(self, tokens: int) -> contextlib.AbstractContextManager[None]:
        return self._one_thread(self.trunk_is_small(tokens))

    def for_heads(self, tokens: int, logit_rows: int) -> contextlib.AbstractContextManager[None]:
        return self._one_thread(self.heads_are_small(tokens, logit_rows))

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
