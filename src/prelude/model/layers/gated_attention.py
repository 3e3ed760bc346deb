"""Full attention with a sigmoid output gate, per-head (1 + w) RMSNorms of q and k and a
partial rotary (Qwen3.5, Qwen3-Next): q_proj gives each head's query and its gate side by
side; the rotary turns the first `rotary_dim` dimensions of each head only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prelude.model.attention import AttentionBackend
from prelude.model.attention.metadata import AttentionMetadata

Linear = Callable[[torch.Tensor], torch.Tensor]


def rms_norm_one_plus(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(1 + weight) * x / rms(x), all in float32, then the model dtype (Gemma's and Qwen3.5's order)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def partial_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF `rotate_half` rotary over the first cos.shape[-1] dims of [T, H, D]; the rest pass."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    turned = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return torch.cat((turned, rest), dim=-1)


@dataclass(frozen=True)
class GatedAttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class GatedAttention:
    """One layer's weights. `qkv`: q_proj (query and gate per head), k_proj, v_proj stacked."""

    def __init__(self, shape: GatedAttentionShape, qkv: Linear, q_norm: torch.Tensor, k_norm: torch.Tensor,
                 o_proj: Linear) -> None:
        self.shape, self.qkv, self.q_norm, self.k_norm, self.o_proj = shape, qkv, q_norm, k_norm, o_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the normed residual stream [T, hidden] -> the layer's output [T, hidden]."""
        s = self.shape
        kv = s.num_kv_heads * s.head_dim
        qg, k, v = self.qkv(x).split([2 * s.num_heads * s.head_dim, kv, kv], dim=-1)
        q, gate = qg.reshape(-1, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
        q = partial_rotate(rms_norm_one_plus(q, self.q_norm, s.eps), cos, sin)
        k = partial_rotate(rms_norm_one_plus(k.reshape(-1, s.num_kv_heads, s.head_dim), self.k_norm, s.eps), cos, sin)
        out = attention.forward(q.contiguous(), k.contiguous(), v.reshape(-1, s.num_kv_heads, s.head_dim).contiguous(),
                                k_cache, v_cache, meta, s.scale)
        gated = out.reshape(x.shape[0], -1) * torch.sigmoid(gate.reshape(x.shape[0], -1))
        return self.o_proj(gated)
