"""The decoder's math between two attention calls, as pure tensor functions.

A forward is: `first` (embedding rows -> layer 0's q/k/v), then per layer the attention
backend (paged KV, Python loops over rows: stays eager), then `between` (layer i's
output projection, MLP and residuals, and layer i+1's norm, q/k/v and rotary) or, after
the last layer, `last` (its output half and the final norm). Every weight is an argument,
so one traced graph serves all layers (same shapes) and every checkpoint with the same
config: a compiled copy (executor/compiled.py) is keyed by config, not by weights.

Eagerly these are the same ops as before; compiled, inductor fuses the residual add into
RMSNorm, SiLU into the gate*up product, and rotary into q/k, and drops the per-op
dispatch of ~20 ops per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerShape:
    """Per-model constants the segments need (specialized into a compiled graph)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    activation: str = "silu"  # the gated MLP's (model/spec.py Activation)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# A projection's weight [out, in], or (CPU bf16) a callable over a oneDNN-prepacked copy
# that carries its own bias; compiled segments take plain tensors only.
Linear = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def linear(x: torch.Tensor, w: Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias) if isinstance(w, torch.Tensor) else w(x)


class PreAttention(NamedTuple):
    """A layer's half before attention."""

    input_norm: torch.Tensor
    qkv: Linear  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None  # None when `qkv` is a prepacked callable (bias inside)
    q_norm: torch.Tensor | None  # Qwen3
    k_norm: torch.Tensor | None


class PostAttention(NamedTuple):
    """A layer's half after attention."""

    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None  # [2 * intermediate, hidden]; None where `mlp` is set
    down: Linear | None
    # A layer whose MLP is not one gated pair of projections (a mixture of experts,
    # model/layers/moe.py): normed hidden [T, hidden] -> the MLP's output
    mlp: Callable[[torch.Tensor], torch.Tensor] | None = None


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF: normalize in float32, scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF `rotate_half` rotary on [T, H, D] with cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_inputs(shape: LayerShape, h: torch.Tensor, w: PreAttention, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
    """Residual stream h [T, hidden] -> rotated q [T, Hq, D], k [T, Hkv, D] and v."""
    qkv = linear(rms_norm(h, w.input_norm, shape.eps), w.qkv, w.qkv_bias)
    q, k, v = qkv.split([shape.q_size, shape.kv_size, shape.kv_size], dim=-1)
    q = q.reshape(-1, shape.num_heads, shape.head_dim)
    k = k.reshape(-1, shape.num_kv_heads, shape.head_dim)
    v = v.reshape(-1, shape.num_kv_heads, shape.head_dim)
    if w.q_norm is not None and w.k_norm is not None:
        q = rms_norm(q, w.q_norm, shape.eps)
        k = rms_norm(k, w.k_norm, shape.eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v.contiguous()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The gated MLP's activations by their model/spec.py names
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": gelu_tanh}


def layer_output(shape: LayerShape, h: torch.Tensor, attn: torch.Tensor, w: PostAttention) -> torch.Tensor:
    """Residual stream after a layer, given its attention output [T, Hq, D]."""
    h = h + linear(attn.reshape(-1, shape.q_size), w.o_proj)
    if w.mlp is not None:
        return h + w.mlp(rms_norm(h, w.post_norm, shape.eps))
    gate, up = linear(rms_norm(h, w.post_norm, shape.eps), w.gate_up).chunk(2, dim=-1)  # type: ignore[arg-type]
    return h + linear(ACTIVATIONS[shape.activation](gate) * up, w.down)  # type: ignore[arg-type]


def first(shape: LayerShape, h: torch.Tensor, w: PreAttention, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
    return attention_inputs(shape, h, w, cos, sin)


def between(
    shape: LayerShape, h: torch.Tensor, attn: torch.Tensor, post: PostAttention, pre: PreAttention,
    cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer i's output half then layer i+1's input half: (h, q, k, v)."""
    h = layer_output(shape, h, attn, post)
    return (h, *attention_inputs(shape, h, pre, cos, sin))


def last(shape: LayerShape, h: torch.Tensor, attn: torch.Tensor, post: PostAttention, norm: torch.Tensor) -> torch.Tensor:
    return rms_norm(layer_output(shape, h, attn, post), norm, shape.eps)


@dataclass(frozen=True)
class DecoderSegments:
    """The three segment callables a forward runs; eager by default, compiled and fused
    copies share the signatures. `label` names the set (logs, tests)."""

    first: Callable[..., QKV] = first
    between: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = between
    last: Callable[..., torch.Tensor] = last
    label: str = "eager"


EAGER_SEGMENTS = DecoderSegments()
