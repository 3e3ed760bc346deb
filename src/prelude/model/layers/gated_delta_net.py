"""A Gated DeltaNet layer (Qwen3.5, Qwen3-Next): input projections, a causal depthwise
conv with its state, the gated delta rule over L2-normed q/k (delta_rule.py), a gated
RMSNorm and the output projection.

The layer's state per sequence is (conv inputs [C, K - 1] in the model dtype, recurrent
state [Hv, dk, dv] float32), kept in a slot of the state pool (StateRows says which);
OneShot rows (slot -1) run on a zero state in the step's scratch, dropped after the forward.
A row may start from a checkpoint slot (a prefix-cache hit) and copy its state at given
tokens into checkpoint slots (StateRow.restore / saves).

On the CPU the conv and the delta rule run as one C call each over all the step's rows
(kernels/cpu/delta_rule.py), from a row table (RowPlan) built once per forward, a
checkpoint inside a row a tap; on CUDA flash-linear-attention's varlen kernels take the
same table (delta_varlen.py); elsewhere, or for checkpoints off the CPU, the rows run one
by one in torch (delta_rule.py), cut in pieces at the checkpoints (no token loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prelude.kernels.cpu.delta_rule import DeltaRuleKernels, load_delta_rule
from prelude.model.attention.metadata import StateRows
from prelude.model.layers import delta_varlen
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


@dataclass(frozen=True)
class RowPlan:
    """The step's rows as the C kernels take them, built once per forward and shared by its
    linear layers: `table` int64 [n, 4] (start, length, dst, src), places as in
    kernels/cpu/delta_rule.py (slot >= 0, scratch -2 - i, zero state -1); `taps` int64
    [m, 2] (token, place) sorted by token, or None; the scratch states, reused layer after layer
    (a OneShot row's state, a packed item's, a tapped state: each dropped after its layer)."""

    table: torch.Tensor
    taps: torch.Tensor | None
    conv_scratch: torch.Tensor
    rec_scratch: torch.Tensor
    tap_places: slice  # the tapped states' entries of the scratch


def plan_rows(rows: StateRows, shape: DeltaNetShape, dtype: torch.dtype, pool: bool,
              device: torch.device | str = "cpu") -> RowPlan:
    """`rows` as one table, in their order (a row restoring a checkpoint that an earlier
    row saves comes after it), then the decode rows, then the decode rows' checkpoints. A
    row whose slot is kept (`pool`: the step has state slots) continues it in place (from
    zeros when fresh, from its checkpoint on a hit); any other row runs on a scratch state;
    each packed item on a scratch state copied from its shared part's end. A checkpoint
    inside a row is a tap into its slot; one before its first token a copy (a row of 0 tokens)."""
    table: list[tuple[int, int, int, int]] = []
    taps: list[tuple[int, int]] = []
    scratch = 0
    for row in rows.rows:
        kept = row.slot >= 0 and pool
        if kept:
            dst = row.slot
        else:
            dst, scratch = -2 - scratch, scratch + 1
        src = row.restore if row.restore >= 0 and pool else (dst if kept and not row.fresh else -1)
        for offset, slot in row.saves if pool else ():
            if offset <= 0:
                table.append((row.start, 0, slot, src))
            else:
                taps.append((row.start + offset - 1, slot))
        shared = row.length - sum(row.items)
        table.append((row.start, shared, dst, src))
        at = row.start + shared
        for n in row.items:  # each item continues the shared part's state on its own
            table.append((at, n, -2 - scratch, dst))
            scratch += 1
            at += n
    if pool and rows.step_tokens is not None and rows.step_slots is not None:
        table.extend((t, 1, s, s) for t, s in zip(rows.step_tokens.tolist(), rows.step_slots.tolist()))
        table.extend((0, 0, checkpoint, slot) for slot, checkpoint in rows.step_saves)
    first_tap = scratch
    taps.extend((t, -2 - (first_tap + i)) for i, t in enumerate(rows.taps))
    scratch += len(rows.taps)
    taps.sort(key=lambda tap: tap[0])
    conv, rec = shape.state_shapes()
    return RowPlan(torch.tensor(table, dtype=torch.int64).reshape(-1, 4),
                   torch.tensor(taps, dtype=torch.int64) if taps else None,
                   torch.empty((scratch, *conv), dtype=dtype, device=device),
                   torch.empty((scratch, *rec), dtype=torch.float32, device=device),
                   slice(first_tap, scratch))


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
                rec_states: torch.Tensor | None, plan: RowPlan | None = None) -> torch.Tensor:
        """x: the normed residual stream [T, hidden] -> the layer's output [T, hidden]; the
        slots of `rows` in conv_states [S, C, K - 1] and rec_states [S, Hv, dk, dv] advance.
        `plan`: the forward's row table (built here when not given)."""
        s = self.shape
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([s.conv_channels, s.value_size, s.num_v_heads, s.num_v_heads], dim=-1)
        g = self.neg_a * F.softplus(a.float() + self.dt_bias.float())  # log decay per token and value head
        kernels = self.kernels_for(x)
        # taps and checkpoints inside rows: the C kernel, or the torch rows cut in pieces
        cut = bool(rows.taps) or any(row.saves for row in rows.rows)
        rule = None if kernels is not None or cut else self.varlen_rule(x)
        if kernels is not None or rule is not None:
            pool = conv_states is not None and rec_states is not None and conv_states.shape[0] > 0
            plan = plan if plan is not None else plan_rows(rows, s, x.dtype, pool, x.device)
            conv_pool, rec_pool = (conv_states, rec_states) if pool else (None, None)
            if kernels is not None:
                out = self._run_rows(kernels, plan, mixed, g, b.sigmoid().float(), conv_pool, rec_pool)
            else:
                out = self.run_varlen(rule, plan, mixed, g, b.sigmoid(), conv_pool, rec_pool)  # type: ignore[arg-type]
            if rows.taps:
                rows.tapped.append((plan.conv_scratch[plan.tap_places].clone(),
                                    plan.rec_scratch[plan.tap_places].clone()))
        else:
            out = self._torch_rows(rows, mixed, g, b.sigmoid(), conv_states, rec_states)
        gate = z.reshape(-1, s.num_v_heads, s.v_dim)
        if kernels is not None:
            normed = kernels.gated_rms_norm(out, self.norm, gate, s.eps)
        else:
            normed = gated_rms_norm(out, self.norm, gate, s.eps)
        return self.out_proj(normed.reshape(x.shape[0], s.value_size))

    def kernels_for(self, x: torch.Tensor) -> DeltaRuleKernels | None:
        """The C kernels where they take x (float32/bf16 on the CPU, head dims they hold)."""
        s = self.shape
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or s.k_dim > 256 \
                or not 2 <= s.conv_kernel <= 8 or self.conv_weight.dtype != x.dtype:
            return None
        return load_delta_rule()

    def uses_plan(self, x: torch.Tensor) -> bool:
        """Whether the layer takes the step's rows as one table (RowPlan) for x."""
        return self.kernels_for(x) is not None or self.varlen_rule(x) is not None

    def varlen_rule(self, x: torch.Tensor) -> delta_varlen.VarlenDeltaRule | None:
        """flash-linear-attention's kernels on CUDA where installed, else None."""
        return delta_varlen.fla_delta_rule if delta_varlen.fla_available(x.device) else None

    def run_varlen(self, rule: delta_varlen.VarlenDeltaRule, plan: RowPlan, mixed: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, conv_states: torch.Tensor | None,
                   rec_states: torch.Tensor | None) -> torch.Tensor:
        """Every row of the plan through varlen kernels (`rule`), a wave at a time. [T, Hv, dv]."""
        s = self.shape
        conv_out = torch.empty_like(mixed, memory_format=torch.contiguous_format)
        out = mixed.new_empty(mixed.shape[0], s.num_v_heads, s.v_dim)
        for wave in delta_varlen.waves(plan.table, mixed.device):
            delta_varlen.conv_wave(wave, mixed, self.conv_weight, conv_states, plan.conv_scratch, conv_out)
            q, k, v = self._split(conv_out)
            delta_varlen.delta_wave(wave, q, k, v, g, beta, rec_states, plan.rec_scratch, s.k_dim**-0.5, rule, out)
        return out

    def _run_rows(self, kernels: DeltaRuleKernels, plan: RowPlan, mixed: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, conv_states: torch.Tensor | None,
                  rec_states: torch.Tensor | None) -> torch.Tensor:
        """Every row of the plan: one conv call, one delta-rule call. [T, Hv, dv]."""
        s = self.shape
        conv_out = kernels.conv(mixed, self.conv_weight, plan.table, conv_states, plan.conv_scratch, plan.taps)
        q, k, v = self._split(conv_out)
        return kernels.delta_rule(q, k, v, g, beta, plan.table, rec_states, plan.rec_scratch, s.k_dim**-0.5,
                                  plan.taps)

    def _torch_rows(self, rows: StateRows, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    conv_states: torch.Tensor | None, rec_states: torch.Tensor | None) -> torch.Tensor:
        """The rows one by one in torch (the decode rows as one batch). [T, Hv, dv]."""
        s = self.shape
        if rows.taps:
            raise ValueError("state taps are computed by the C kernel only (PRELUDE_DELTA_RULE=0 turns it off)")
        out = mixed.new_empty(mixed.shape[0], s.num_v_heads, s.v_dim)
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
                # a save before any token of a fresh row is the zero state
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
        return out

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
