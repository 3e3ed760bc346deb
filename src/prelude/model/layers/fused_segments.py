"""The decoder's segments (see decoder_segments.py) on fused elementwise kernels: the same
math, the same signatures, four kernel calls per layer instead of ~25 ops. Built over
either kernel set with the same four functions: the Triton kernels (kernels/triton/fused.py,
CUDA, captured by the CUDA graphs) or the C kernels (kernels/cpu/cpu_fused.py, float32 and
bfloat16 on the CPU).
The executor picks them (ExecutorConfig.fused_kernels)."""

from __future__ import annotations

from typing import Protocol

import torch

from prelude.model.layers.decoder_segments import QKV, DecoderSegments, PreAttention, LayerShape, PostAttention, linear


class ElementwiseKernels(Protocol):
    """What a fused kernel set provides (kernels/triton/fused.py's module functions, or
    CpuFusedKernels' methods)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def qk_norm_rope(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                     sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                     eps: float) -> QKV: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def fused_segments(kernels: ElementwiseKernels, label: str) -> DecoderSegments:
    """first/between/last over `kernels`."""

    def qkv_of(shape: LayerShape, normed: torch.Tensor, w: PreAttention, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
        qkv = linear(normed, w.qkv, w.qkv_bias)
        return kernels.qk_norm_rope(qkv, shape.num_heads, shape.num_kv_heads, shape.head_dim, cos, sin, w.q_norm,
                                    w.k_norm, shape.eps)

    def post_attention(shape: LayerShape, h: torch.Tensor, attn: torch.Tensor,
                       w: PostAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer output before its last residual add: (h after attention, the MLP's output)."""
        h, normed = kernels.add_rms_norm(h, linear(attn.reshape(-1, shape.q_size), w.o_proj), w.post_norm, shape.eps)
        return h, linear(kernels.silu_mul(linear(normed, w.gate_up)), w.down)

    def first(shape: LayerShape, h: torch.Tensor, w: PreAttention, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
        return qkv_of(shape, kernels.rms_norm(h, w.input_norm, shape.eps), w, cos, sin)

    def between(
        shape: LayerShape, h: torch.Tensor, attn: torch.Tensor, post_w: PostAttention, pre: PreAttention,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        h, mlp = post_attention(shape, h, attn, post_w)
        h, normed = kernels.add_rms_norm(h, mlp, pre.input_norm, shape.eps)
        return (h, *qkv_of(shape, normed, pre, cos, sin))

    def last(shape: LayerShape, h: torch.Tensor, attn: torch.Tensor, post_w: PostAttention,
             norm: torch.Tensor) -> torch.Tensor:
        h, mlp = post_attention(shape, h, attn, post_w)
        return kernels.add_rms_norm(h, mlp, norm, shape.eps)[1]

    return DecoderSegments(first=first, between=between, last=last, label=label)


def triton_segments() -> DecoderSegments:
    """The segments over the Triton kernels (imports triton: ImportError without it)."""
    from prelude.kernels.triton import fused as fused_kernels

    return fused_segments(fused_kernels, "triton")  # type: ignore[arg-type]  # a module with the four functions
