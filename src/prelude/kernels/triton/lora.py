"""Triton kernels for the LoRA delta on CUDA, BGMV-style: every token reads its own
adapter's slot from a per-token index, so one launch pair serves any mix of adapters and
the base (slot -1: nothing added), and a CUDA graph replays it with the index as an input.

- shrink: y[t] = x[t] @ A[slot t]        ([T, in] x [S, in, R] -> [T, R], float32)
- expand: out[t] += y[t] @ B[slot t]     ([T, R] x [S, R, out], in place)

Each program owns one token and a tile of the output columns and reduces in float32.
Shapes only (no host reads), so CUDA graphs capture them; they also run on CPU tensors
under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(X, Slots, A, Y, stride_x, stride_as, stride_ai, stride_y, N_IN, R,
                   BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rs < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, N_IN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = (ks < N_IN) & (ks * 0 + slot >= 0)  # a base token (slot -1) reads nothing
        x = tl.load(X + t * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(A + tl.maximum(slot, 0) * stride_as + ks[:, None] * stride_ai + rs[None, :],
                    mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None] * a, axis=0)
    tl.store(Y + t * stride_y + rs, acc, mask=r_mask)


@triton.jit
def _expand_kernel(Y, Slots, B, Out, stride_y, stride_bs, stride_br, stride_o, R, N_OUT,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (ns < N_OUT) & (ns * 0 + slot >= 0)  # a base token's output is left untouched
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < R
    y = tl.load(Y + t * stride_y + rs, mask=r_mask, other=0.0)
    b = tl.load(B + tl.maximum(slot, 0) * stride_bs + rs[:, None] * stride_br + ns[None, :],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(y[:, None] * b, axis=0)
    o = tl.load(Out + t * stride_o + ns, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_o + ns, (o + delta).to(Out.dtype.element_ty), mask=n_mask)


def lora_delta_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
    """out[t] += (x[t] @ a[s]) @ b[s] where s = token_slots[t] >= 0; out, x: [T, *] and
    a: [S, in, R] with unit last stride; b: [S, R, out] contiguous. Returns out."""
    tokens, n_in = x.shape
    rank, n_out = b.shape[1], b.shape[2]
    assert out.shape == (tokens, n_out) and a.shape[1:] == (n_in, rank) and token_slots.shape == (tokens,)
    assert out.stride(1) == 1 and x.stride(1) == 1 and a.stride(2) == 1 and b.is_contiguous()
    if tokens == 0:
        return out
    y = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    block_r = min(triton.next_power_of_2(rank), 64)
    _shrink_kernel[(tokens, triton.cdiv(rank, block_r))](
        x, token_slots, a, y, x.stride(0), a.stride(0), a.stride(1), y.stride(0), n_in, rank,
        BLOCK_K=64, BLOCK_R=block_r)
    block_r_all = triton.next_power_of_2(rank)
    block_n = max(16, min(128, 4096 // block_r_all))
    _expand_kernel[(tokens, triton.cdiv(n_out, block_n))](
        y, token_slots, b, out, y.stride(0), b.stride(0), b.stride(1), out.stride(0), rank, n_out,
        BLOCK_R=block_r_all, BLOCK_N=block_n)
    return out
