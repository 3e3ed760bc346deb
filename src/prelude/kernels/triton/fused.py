"""Triton kernels for the elementwise work between a decoder layer's GEMMs (CUDA).

Eagerly, the math between two GEMMs of a layer is ~25 small kernels (dtype casts, the
RMSNorm reduction, the rotary halves and their cat, SiLU, the products). On a GPU each
launch has a fixed cost even inside a CUDA graph, so for a small model at short prompts
these hundreds of small kernels take most of the forward's device time, more than the
GEMMs. These kernels do the same math in four launches per layer:

- `add_rms_norm`: the residual add and the next RMSNorm (one read of each operand);
- `rms_norm`: the same without a residual (the first layer's input norm);
- `qk_norm_rope`: split q/k/v out of the fused projection, Qwen3's per-head q/k RMSNorm,
  and rotary, writing contiguous q, k, v;
- `silu_mul`: SiLU(gate) * up.

Numerics follow the eager ops step by step, rounding to the activation dtype wherever an
eager op would store a tensor (`_round`), so bf16 outputs equal the eager ones up to the
order of the RMSNorm sum. Every launch is shape-driven (no host reads), so CUDA graphs
capture them. They also run on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """What storing float32 x as DTYPE and reading it back gives (a no-op for float32).
    bf16 rounds to nearest-even by hand: TRITON_INTERPRET's cast truncates, and this way the
    tests under the interpreter see the rounding the GPU does (finite values)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, N, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = Out.dtype.element_ty
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = _round(x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(ResOut + row * stride_ro + cols, x.to(dtype), mask=mask)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = _round(x * tl.rsqrt(var + eps), dtype)
    tl.store(Out + row * stride_o + cols, _round(w * y, dtype).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = _rows(x)
    n = x.shape[-1]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    r = _rows(residual) if residual is not None else x
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(x.shape[0],)](
        x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0), res_out.stride(0), n, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return res_out, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, N] (the eager `rms_norm`'s numerics)."""
    return _norm_launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm(h)) with h = x + residual, both [T, N]."""
    return _norm_launch(x, residual, weight, eps)


@triton.jit
def _rotary_heads(
    Src, Dst, NormW, cos1, sin1, cos2, sin2, t, stride_src, stride_dst, col0, num_heads, eps,
    HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, DTYPE: tl.constexpr,
):
    """Heads [col0, col0 + num_heads * 2 * HALF) of token t's row: optional per-head
    RMSNorm, then HF rotate_half rotary; written as [num_heads, 2 * HALF] at Dst's row t."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < num_heads
    src = Src + t * stride_src + col0 + h * (2 * HALF) + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inv = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(NormW + d).to(tl.float32)
        w2 = tl.load(NormW + HALF + d).to(tl.float32)
        x1 = _round(w1 * _round(x1 * inv, DTYPE), DTYPE)
        x2 = _round(w2 * _round(x2 * inv, DTYPE), DTYPE)
    # eager: x * cos + cat(-x2, x1) * sin, each product stored before the sum
    o1 = _round(x1 * cos1, DTYPE) + _round(-x2 * sin1, DTYPE)
    o2 = _round(x2 * cos2, DTYPE) + _round(x1 * sin2, DTYPE)
    dst = Dst + t * stride_dst + h * (2 * HALF) + d
    tl.store(dst, _round(o1, DTYPE).to(DTYPE), mask=mask)
    tl.store(dst + HALF, _round(o2, DTYPE).to(DTYPE), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    QKV, Cos, Sin, QNorm, KNorm, Q, K, V, stride_qkv, stride_cos, stride_sin, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dtype = Q.dtype.element_ty
    d = tl.arange(0, HALF)[None, :]
    cos1 = tl.load(Cos + t * stride_cos + d).to(tl.float32)
    cos2 = tl.load(Cos + t * stride_cos + HALF + d).to(tl.float32)
    sin1 = tl.load(Sin + t * stride_sin + d).to(tl.float32)
    sin2 = tl.load(Sin + t * stride_sin + HALF + d).to(tl.float32)
    q_size = NUM_HEADS * 2 * HALF
    kv_size = NUM_KV_HEADS * 2 * HALF
    _rotary_heads(QKV, Q, QNorm, cos1, sin1, cos2, sin2, t, stride_qkv, q_size, 0, NUM_HEADS, eps,
                  HAS_NORM, BLOCK_HQ, HALF, dtype)
    _rotary_heads(QKV, K, KNorm, cos1, sin1, cos2, sin2, t, stride_qkv, kv_size, q_size, NUM_KV_HEADS, eps,
                  HAS_NORM, BLOCK_HKV, HALF, dtype)
    c = tl.arange(0, BLOCK_HKV * 2 * HALF)
    v = tl.load(QKV + t * stride_qkv + q_size + kv_size + c, mask=c < kv_size)
    tl.store(V + t * kv_size + c, v, mask=c < kv_size)


def qk_norm_rope(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) * D] -> rotated q [T, Hq, D], k [T, Hkv, D] and v [T, Hkv, D]
    (contiguous); cos/sin [T, 1, D] or [T, D]; q/k norms both or neither (Qwen3 has both)."""
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim) == head_dim, "head_dim: a power of two"
    qkv = _rows(qkv)
    t = qkv.shape[0]
    q = qkv.new_empty(t, num_heads, head_dim)
    k = qkv.new_empty(t, num_kv_heads, head_dim)
    v = qkv.new_empty(t, num_kv_heads, head_dim)
    cos2d, sin2d = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
    has_norm = q_norm is not None and k_norm is not None
    _qk_norm_rope_kernel[(t,)](
        qkv, cos2d, sin2d, q_norm if has_norm else qkv, k_norm if has_norm else qkv, q, k, v,
        qkv.stride(0), cos2d.stride(0), sin2d.stride(0), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        HAS_NORM=has_norm, num_warps=4,
    )
    return q, k, v


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = Out.dtype.element_ty
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + N + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), dtype)  # eager F.silu stores its result
    tl.store(Out + row * stride_o + cols, _round(s * u, dtype).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> SiLU(gate) * up [T, I]."""
    gate_up = _rows(gate_up)
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(t, n)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block,
                                                 num_warps=4)
    return out
