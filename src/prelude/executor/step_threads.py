"""How many CPU threads a step's forward runs on: one for steps too small to split.

Every torch op of a forward is a parallel region of the OpenMP team: the team wakes,
splits the op and joins. On a step whose whole work is ~0.1 GFLOP (a 128-token prompt
through a 2-layer toy model, a decode row of a tiny model) those joins are the step, and
on a busy machine a join waits for a team thread the OS has not scheduled yet: a free
model's 128-token forward took 40-65 ms on two threads at load average 8, 0.9-1.8 ms on
one (bench overhead). Larger steps keep the whole team; on CUDA this does nothing.
Setting the count costs ~0.2 µs and applies to the calling (engine) thread's team.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

# Below this estimate of a step's multiply-adds x 2 the forward runs on one thread: a
# few hundred microseconds of work, where splitting saves less than the joins cost.
SMALL_STEP_FLOPS = 1e8


class StepThreads:
    """`flops_per_token`: 2 x the weights a token passes through (embeddings left out);
    `flops_per_logit_row`: 2 x the LM head's weights (one per sampled row)."""

    def __init__(self, device: torch.device, flops_per_token: float, flops_per_logit_row: float) -> None:
        # A config the estimate cannot read (0 flops) never counts as small.
        self.enabled = device.type == "cpu" and torch.get_num_threads() > 1 and flops_per_token > 0
        self.flops_per_token = flops_per_token
        self.flops_per_logit_row = flops_per_logit_row

    def is_small(self, tokens: int, logit_rows: int) -> bool:
        return tokens * self.flops_per_token + logit_rows * self.flops_per_logit_row < SMALL_STEP_FLOPS

    @contextmanager
    def for_step(self, tokens: int, logit_rows: int) -> Iterator[None]:
        if not self.enabled or not self.is_small(tokens, logit_rows):
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
