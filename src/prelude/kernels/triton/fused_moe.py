"""A mixture of experts' chosen experts on CUDA: two Triton launches over the tokens sorted
by expert (model/layers/moe.py's CUDA path).

`align_by_expert` lays the (token, slot) pairs out by expert, each expert's run padded to
whole blocks of BLOCK_M rows (a padding slot is the sentinel T * k), and says which expert
each block belongs to (-1: a block past the last used one). Then:
- `_gate_up_kernel`: a program a (block, BLOCK_N intermediates): the block's token rows
  against its expert's gate and up rows, SiLU(gate) * up stored per slot;
- `_down_kernel`: a program a (block, BLOCK_N outputs): those rows through the expert's
  down rows, times the slot's router weight, stored per slot;
and each token's k slot outputs are added in ascending expert order (torch, k adds).
Only the chosen experts' weights are read: a block's program reads its expert's rows.

Numerics follow transformers' Qwen3-MoE block as the CPU kernel does: gate, up and down
rounded to the dtype, SiLU of the rounded gate rounded, times up; down's output times the
rounded weight, rounded; the sums in ascending expert order, each rounded (float32 dots in
IEEE precision, not TF32). Every launch and torch op is shape-driven (no host reads: the
counts are a scatter-add, not bincount), so CUDA graphs capture them. The kernels also run
on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prelude.kernels.triton.attention import _dot_f32
from prelude.kernels.triton.fused import _round


@triton.jit
def _gate_up_kernel(
    X, W, Slots, BlockExpert, Act, stride_x, stride_we, stride_wn, stride_act, S, TOPK, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    e = tl.load(BlockExpert + b).to(tl.int64)
    slot = tl.load(Slots + b * BLOCK_M + tl.arange(0, BLOCK_M))
    rows = slot < tl.where(e >= 0, S, 0)  # padding slots and unused blocks compute nothing they store
    token = tl.where(rows, slot // TOPK, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n < tl.where(e >= 0, I, 0)  # an unused block reads no weights
    w_e = W + tl.maximum(e, 0) * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ks = offs_k < H
        a = tl.load(X + token[:, None] * stride_x + offs_k[None, :], mask=rows[:, None] & ks[None, :], other=0.0)
        wmask = ks[:, None] & cols[None, :]
        wg = tl.load(w_e + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_e + (I + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
        if DOT_F32:  # the interpreter's tl.dot mishandles 16-bit floats (attention.py's _dot_f32)
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        if IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    dtype = Act.dtype.element_ty
    g = _round(acc_g, dtype)
    u = _round(acc_u, dtype)
    h = _round(_round(g / (1.0 + tl.exp(-g)), dtype) * u, dtype)
    tl.store(Act + tl.where(rows, slot, 0)[:, None] * stride_act + offs_n[None, :], h.to(dtype),
             mask=rows[:, None] & cols[None, :])


@triton.jit
def _down_kernel(
    Act, W, Slots, BlockExpert, Weights, Y, stride_act, stride_we, stride_wn, stride_y, S, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    e = tl.load(BlockExpert + b).to(tl.int64)
    slot = tl.load(Slots + b * BLOCK_M + tl.arange(0, BLOCK_M))
    rows = slot < tl.where(e >= 0, S, 0)
    safe = tl.where(rows, slot, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n < tl.where(e >= 0, H, 0)
    w_e = W + tl.maximum(e, 0) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ks = offs_k < I
        a = tl.load(Act + safe[:, None] * stride_act + offs_k[None, :], mask=rows[:, None] & ks[None, :], other=0.0)
        w = tl.load(w_e + offs_n[None, :] * stride_wn + offs_k[:, None], mask=ks[:, None] & cols[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    dtype = Y.dtype.element_ty
    weight = _round(tl.load(Weights + safe, mask=rows, other=0.0).to(tl.float32), dtype)
    y = _round(_round(acc, dtype) * weight[:, None], dtype)
    tl.store(Y + safe[:, None] * stride_y + offs_n[None, :], y.to(dtype), mask=rows[:, None] & cols[None, :])


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (slots [blocks * block_m]: the flat (token * k + j) indices grouped
    by expert, token order within one, each expert's run padded with T * k to whole blocks;
    block_expert [blocks]: each block's expert, -1 past the used ones). `blocks` is the
    most any routing of T * k slots can use, so the shapes follow T, k and E only."""
    flat = experts.reshape(-1)
    s = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first = ends - padded - (torch.cumsum(counts, 0) - counts)  # an expert's padded start less its sorted start
    sorted_e = flat[order]
    blocks = -(-s // block_m) + min(num_experts, s)  # each chosen expert adds at most one part block
    slots = torch.full((blocks * block_m,), s, dtype=torch.int64, device=flat.device)
    slots[torch.arange(s, device=flat.device) + first[sorted_e]] = order
    block_expert = torch.searchsorted(ends, torch.arange(blocks, device=flat.device) * block_m, right=True)
    return slots, torch.where(block_expert < num_experts, block_expert, -1)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (each expert's gate rows, then its up rows); down
    [E, H, I]; weights and experts [T, k] (the router's) -> [T, H], x's dtype."""
    t, h = x.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    k = experts.shape[1]
    if gate_up.shape[2] != h or down.shape != (e, h, inter) or weights.shape != experts.shape or experts.shape[0] != t:
        raise ValueError(f"fused MoE: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
                         f"weights {tuple(weights.shape)}, experts {tuple(experts.shape)}")
    if t == 0:
        return x.clone()
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    s = t * k
    # larger blocks once an expert averages enough rows to fill them
    block_m = 16 if s <= 4 * e else 64
    slots, block_expert = align_by_expert(experts.to(torch.int64), e, block_m)
    blocks = block_expert.numel()
    act = torch.empty(s, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(s, h, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    dot_f32 = _dot_f32(x.dtype)
    bk = 32 if ieee else 64
    bn = 64
    _gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
        x, gate_up, slots, block_expert, act, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        s, k, h, inter, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee,
        DOT_F32=dot_f32)
    _down_kernel[(blocks, triton.cdiv(h, bn))](
        act, down, slots, block_expert, weights.reshape(-1).to(torch.float32).contiguous(), y, act.stride(0),
        down.stride(0), down.stride(1), y.stride(0), s, h, inter, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee,
        DOT_F32=dot_f32)
    # each token's slots in ascending expert order, added one by one (rounded as index_add_ rounds)
    order = torch.argsort(experts, dim=1)
    ys = y.view(t, k, h).gather(1, order.unsqueeze(-1).expand(t, k, h))
    out = ys[:, 0].clone()
    for j in range(1, k):
        out = out + ys[:, j]
    return out
