"""A Gated DeltaNet layer (Qwen3.5, Qwen3-Next): input projections, a causal depthwise
conv with its state, the gated delta rule over L2-normed q/k (delta_rule.py), a gated
RMSNorm and the output projection.

The layer's state per sequence is (conv inputs [C, K - 1] in the model dtype, recurrent
state [Hv, dk, dv] float32), kept in a slot of the state pool (StateRows says which);
OneShot rows (slot -1) run on a zero state that is dropped after the forward. A row may
start from a checkpoint slot (a prefix-cache hit) and copy its state at given tokens into
checkpoint slots (StateRow.restore / saves): it runs in pieces cut there, no token loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prelude.model.attention.metadata import StateRows
from prelude.model.layers.delta_rule import (
    causal_conv,
    causal_conv_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_step,
)

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DeltaNetShape:
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    eps: float

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_size + self.value_size

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) of one sequence."""
        return (self.conv_channels, self.conv_kernel - 1), (self.num_v_heads, self.k_dim, self.v_dim)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv, rec = self.state_shapes()
        return conv[0] * conv[1] * dtype.itemsize + rec[0] * rec[1] * rec[2] * 4


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim (float32, scaled in the model dtype), times silu(gate)."""
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet:
    """One layer's weights. `in_proj`: q/k/v, z, b and a stacked in one projection."""

    def __init__(self, shape: DeltaNetShape, in_proj: Linear, conv_weight: torch.Tensor, dt_bias: torch.Tensor,
                 a_log: torch.Tensor, norm: torch.Tensor, out_proj: Linear) -> None:
        self.shape = shape
        self.in_proj = in_proj
        self.conv_weight = conv_weight.reshape(shape.conv_channels, shape.conv_kernel)
        self.dt_bias = dt_bias
        self.neg_a = -a_log.float().exp()  # the decay's rate, -exp(A_log), float32
        self.norm = norm
        self.out_proj = out_proj

    def forward(self, x: torch.Tensor, rows: StateRows, conv_states: torch.Tensor | None,
                rec_states: torch.Tensor | None) -> torch.Tensor:
        """x: the normed residual stream [T, hidden] -> the layer's output [T, hidden]; the
        slots of `rows` in conv_states [S, C, K - 1] and rec_states [S, Hv, dk, dv] advance."""
        s = self.shape
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([s.conv_channels, s.value_size, s.num_v_heads, s.num_v_heads], dim=-1)
        beta = b.sigmoid()
        g = self.neg_a * F.softplus(a.float() + self.dt_bias.float())  # log decay per token and value head
        out = x.new_empty(x.shape[0], s.num_v_heads, s.v_dim)
        for row in rows.rows:
            kept = row.slot >= 0 and conv_states is not None and rec_states is not None
            source = row.restore if row.restore >= 0 else (row.slot if kept and not row.fresh else -1)
            conv_new = None if source < 0 else conv_states[source]  # type: ignore[index]
            rec_new = None if source < 0 else rec_states[source]  # type: ignore[index]
            shared = row.length - sum(row.items)
            at = row.start
            for offset, slot in row.saves:  # the shared part in pieces, a checkpoint after each
                if offset > at - row.start:
                    conv_new, rec_new = self._run(mixed, g, beta, out, at, row.start + offset - at, conv_new, rec_new)
                    at = row.start + offset
                conv_states[slot].copy_(conv_new if conv_new is not None else 0)  # type: ignore[index]
                rec_states[slot].copy_(rec_new if rec_new is not None else 0)  # type: ignore[index]
            if at < row.start + shared or conv_new is None:
                conv_new, rec_new = self._run(mixed, g, beta, out, at, row.start + shared - at, conv_new, rec_new)
            at = row.start + shared
            for n in row.items:  # each item continues the shared part's state on its own
                self._run(mixed, g, beta, out, at, n, conv_new, rec_new)
                at += n
            if kept:
                conv_states[row.slot].copy_(conv_new)  # type: ignore[index]
                rec_states[row.slot].copy_(rec_new)  # type: ignore[index]
        if rows.step_tokens is not None and rows.step_slots is not None and conv_states is not None \
                and rec_states is not None:
            idx, slots = rows.step_tokens, rows.step_slots
            conv = conv_states.index_select(0, slots)
            rec = rec_states.index_select(0, slots)
            q, k, v = self._split(causal_conv_step(mixed.index_select(0, idx), self.conv_weight, conv))
            o = recurrent_gated_delta_step(q, k, v, g.index_select(0, idx), beta.index_select(0, idx), rec)
            out.index_copy_(0, idx, o)
            conv_states.index_copy_(0, slots, conv)
            rec_states.index_copy_(0, slots, rec)
            for slot, checkpoint in rows.step_saves:
                conv_states[checkpoint].copy_(conv_states[slot])
                rec_states[checkpoint].copy_(rec_states[slot])
        normed = gated_rms_norm(out, self.norm, z.reshape(-1, s.num_v_heads, s.v_dim), s.eps)
        return self.out_proj(normed.reshape(x.shape[0], s.value_size))

    def _run(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor, start: int,
             length: int, conv_in: torch.Tensor | None, rec_in: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [start, start + length) from the given states (None: zeros) into `out`;
        the states after them (conv [C, K - 1], recurrent [Hv, dk, dv] float32)."""
        span = slice(start, start + length)
        conv_out, conv_new = causal_conv(mixed[span], self.conv_weight, conv_in)
        q, k, v = self._split(conv_out)
        o, rec_new = chunk_gated_delta_rule(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g[span].unsqueeze(0),
                                            beta[span].unsqueeze(0), None if rec_in is None else rec_in.unsqueeze(0))
        out[span] = o[0]
        return conv_new, rec_new[0]

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        q, k, v = conv_out.split([s.key_size, s.key_size, s.value_size], dim=-1)
        return (q.reshape(-1, s.num_k_heads, s.k_dim), k.reshape(-1, s.num_k_heads, s.k_dim),
                v.reshape(-1, s.num_v_heads, s.v_dim))
