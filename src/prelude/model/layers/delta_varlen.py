"""A step's rows for the linear layers on CUDA: the causal conv as one gather in torch and
the gated delta rule through flash-linear-attention's varlen Triton kernels (chunked for
prompt rows, fused recurrent when every row is one decode token), no Python per row.

Rows come as the CPU kernels' table (gated_delta_net.RowPlan: start, length, dst, src;
places: slot >= 0, scratch -2 - i, zero state -1). A row may start from a place that an
earlier row of the step writes (a packed item from its shared part): such rows run in a
second wave, after the rows they read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (q [1, N, Hk, dk], k, v [1, N, Hv, dv], g, beta [1, N, Hv], initial states [R, Hv, dk, dv]
# float32, cu_seqlens [R + 1] int64 on the device, scale, one token per row) ->
# (out [1, N, Hv, dv], final states [R, Hv, dk, dv] float32); q/k L2-normed inside
VarlenDeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Wave:
    """Rows that only read states written before the step (or by an earlier wave)."""

    rows: list[tuple[int, int, int, int]]
    tokens: torch.Tensor  # [N] int64: the rows' tokens, row after row, on the device
    cu_seqlens: torch.Tensor  # [R + 1] int64 on the device
    one_token: bool


def waves(table: torch.Tensor, device: torch.device) -> list[Wave]:
    """The table's rows in waves: a row whose src some row of the step writes waits for it."""
    rows = [tuple(int(x) for x in r) for r in table.tolist()]
    out: list[Wave] = []
    while rows:
        now = [r for r in rows if r[3] == r[2] or r[3] not in {d for _, _, d, _ in rows if d != r[2]}]
        if not now:
            raise ValueError("the rows' states depend on each other in a cycle")
        rows = [r for r in rows if r not in now]
        lens = torch.tensor([r[1] for r in now], dtype=torch.int64)
        starts = torch.tensor([r[0] for r in now], dtype=torch.int64)
        cu = F.pad(lens.cumsum(0), (1, 0))
        row_of = torch.repeat_interleave(torch.arange(len(now)), lens)
        tokens = starts[row_of] + torch.arange(int(cu[-1])) - cu[:-1][row_of]
        out.append(Wave(now, tokens.to(device), cu.to(device), all(r[1] == 1 for r in now)))
    return out


def _gather_states(pool: torch.Tensor | None, scratch: torch.Tensor, places: list[int],
                   shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The states at `places` stacked [R, ...] (zeros for -1)."""
    device = scratch.device
    out = torch.zeros((len(places), *shape), dtype=dtype, device=device)
    for store, pick in ((pool, [i for i, p in enumerate(places) if p >= 0]),
                        (scratch, [i for i, p in enumerate(places) if p <= -2])):
        if pick and store is not None:
            idx = torch.tensor([places[i] if places[i] >= 0 else -2 - places[i] for i in pick], device=device)
            out[torch.tensor(pick, device=device)] = store.index_select(0, idx).to(dtype)
    return out


def _scatter_states(pool: torch.Tensor | None, scratch: torch.Tensor, places: list[int], states: torch.Tensor) -> None:
    device = scratch.device
    for store, pick in ((pool, [i for i, p in enumerate(places) if p >= 0]),
                        (scratch, [i for i, p in enumerate(places) if p <= -2])):
        if pick and store is not None:
            idx = torch.tensor([places[i] if places[i] >= 0 else -2 - places[i] for i in pick], device=device)
            store.index_copy_(0, idx, states[torch.tensor(pick, device=device)].to(store.dtype))


def conv_wave(wave: Wave, mixed: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor | None,
              scratch: torch.Tensor, out: torch.Tensor) -> None:
    """SiLU(causal depthwise conv) of the wave's tokens into out [T, C]; states advance."""
    n_rows, width = len(wave.rows), weight.shape[1] - 1
    init = _gather_states(pool, scratch, [r[3] for r in wave.rows], (weight.shape[0], width), mixed.dtype)
    # every row's K - 1 inputs before it, then its own tokens: one table to gather windows from
    ext = torch.cat([init.transpose(1, 2).reshape(n_rows * width, -1), mixed.index_select(0, wave.tokens)])
    lens = wave.cu_seqlens.diff()
    row_of = torch.repeat_interleave(torch.arange(n_rows, device=ext.device), lens)
    offset = torch.arange(wave.tokens.shape[0], device=ext.device) - wave.cu_seqlens[:-1][row_of]
    taps = torch.arange(-width, 1, device=ext.device)
    pos = offset[:, None] + taps[None, :]  # [N, K]: the window's positions within the row
    before = row_of[:, None] * width + width + pos  # a position < 0: the row's initial state
    idx = torch.where(pos >= 0, n_rows * width + wave.cu_seqlens[:-1][row_of][:, None] + pos, before)
    windows = ext[idx]  # [N, K, C]
    conv = (windows.float() * weight.t().float()[None]).sum(1).to(mixed.dtype)
    out.index_copy_(0, wave.tokens, F.silu(conv))
    ends = wave.cu_seqlens[1:] - 1  # each row's last token; its state is the last K - 1 inputs
    end_pos = (lens - 1)[:, None] + torch.arange(-width + 1, 1, device=ext.device)[None, :]
    rows_ar = torch.arange(n_rows, device=ext.device)[:, None]
    end_idx = torch.where(end_pos >= 0, n_rows * width + ends[:, None] - (lens - 1)[:, None] + end_pos,
                          rows_ar * width + width + end_pos)
    _scatter_states(pool, scratch, [r[2] for r in wave.rows], ext[end_idx].transpose(1, 2))


def delta_wave(wave: Wave, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               pool: torch.Tensor | None, scratch: torch.Tensor, scale: float, rule: VarlenDeltaRule,
               out: torch.Tensor) -> None:
    """The gated delta rule over the wave's rows into out [T, Hv, dv]; states advance."""
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    init = _gather_states(pool, scratch, [r[3] for r in wave.rows], (hv, dk, dv), torch.float32)
    pick = (lambda x: x.index_select(0, wave.tokens).unsqueeze(0).contiguous())  # noqa: E731
    o, final = rule(pick(q), pick(k), pick(v), pick(g), pick(beta), init, wave.cu_seqlens, scale, wave.one_token)
    out.index_copy_(0, wave.tokens, o[0].to(out.dtype))
    _scatter_states(pool, scratch, [r[2] for r in wave.rows], final)


def fla_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   init: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                   one_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-linear-attention's kernels (a VarlenDeltaRule)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    if one_token:  # decode rows: [R, 1, ...] batches for the fused recurrent kernel
        as_batch = (lambda x: x.transpose(0, 1))  # noqa: E731
        o, final = fused_recurrent_gated_delta_rule(
            as_batch(q), as_batch(k), as_batch(v), as_batch(g), as_batch(beta), scale=scale, initial_state=init,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o.transpose(0, 1), final
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=init, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)


def fla_available(device: torch.device) -> bool:
    """Whether flash-linear-attention's kernels serve `device` (CUDA with fla installed)."""
    if device.type != "cuda":
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # noqa: BLE001 - fla missing or its Triton too old: the torch rows serve
        return False
    return True
