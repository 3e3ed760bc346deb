"""The decoder's segments (see decoder_segments.py) on the fused Triton kernels: the same
math, the same signatures, ~10 launches per layer instead of ~35. For CUDA; the executor
picks them (ExecutorConfig.fused_kernels) and the CUDA graphs capture them."""

from __future__ import annotations

import torch

from prelude.model.decoder_segments import QKV, DecoderSegments, HeadWeights, LayerShape, TailWeights, linear
from prelude.model.fused_kernels import add_rms_norm, qk_norm_rope, rms_norm, silu_mul


def _qkv(shape: LayerShape, normed: torch.Tensor, w: HeadWeights, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
    qkv = linear(normed, w.qkv, w.qkv_bias)
    return qk_norm_rope(qkv, shape.num_heads, shape.num_kv_heads, shape.head_dim, cos, sin, w.q_norm, w.k_norm,
                        shape.eps)


def _tail(shape: LayerShape, h: torch.Tensor, attn: torch.Tensor, w: TailWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer output before its last residual add: (h after attention, the MLP's output)."""
    h, normed = add_rms_norm(h, linear(attn.reshape(-1, shape.q_size), w.o_proj), w.post_norm, shape.eps)
    return h, linear(silu_mul(linear(normed, w.gate_up)), w.down)


def first(shape: LayerShape, h: torch.Tensor, w: HeadWeights, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
    return _qkv(shape, rms_norm(h, w.input_norm, shape.eps), w, cos, sin)


def between(
    shape: LayerShape, h: torch.Tensor, attn: torch.Tensor, tail: TailWeights, head: HeadWeights,
    cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h, mlp = _tail(shape, h, attn, tail)
    h, normed = add_rms_norm(h, mlp, head.input_norm, shape.eps)
    return (h, *_qkv(shape, normed, head, cos, sin))


def last(shape: LayerShape, h: torch.Tensor, attn: torch.Tensor, tail: TailWeights, norm: torch.Tensor) -> torch.Tensor:
    h, mlp = _tail(shape, h, attn, tail)
    return add_rms_norm(h, mlp, norm, shape.eps)[1]


FUSED_SEGMENTS = DecoderSegments(first=first, between=between, last=last)
