"""What an architecture file says about its layers: a frozen description the shared layers
compose and the fast paths read to say whether they can run a model.

A decoder is an embedding, a stack of layers and a final norm. Each layer names its
attention kind (full, sliding window or linear-recurrent), its rotary, its MLP (dense or
mixture of experts) with its activation, and its norm form. Nothing here holds a tensor:
two checkpoints of the same config have equal descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# "rms": weight * x / rms(x) (Llama); "rms_one_plus": (1 + weight) * x / rms(x) (Gemma, Qwen3.5)
NormKind = Literal["rms", "rms_one_plus"]
# The gated MLP's activation on the gate: silu(gate) * up, or gelu_tanh(gate) * up
Activation = Literal["silu", "gelu_tanh"]
# full: every earlier token; sliding: the last `window` tokens; linear: a recurrent state
AttentionKind = Literal["full", "sliding", "linear"]
MlpKind = Literal["dense", "moe"]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer kind: its base, its scaling (HF's rope_scaling items,
    sorted) and how many of the head's dimensions it turns (partial rotary: fewer)."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] | None
    rotary_dim: int


@dataclass(frozen=True)
class AttentionSpec:
    kind: AttentionKind
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec | None
    scale: float  # applied to q.k (head_dim ** -0.5, or a config's query_pre_attn_scalar)
    window: int | None = None  # sliding layers: how many tokens back a query sees
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary
    logit_softcap: float | None = None  # tanh soft-capping of attention scores
    output_gate: bool = False  # a sigmoid gate on the attention output


@dataclass(frozen=True)
class MoeSpec:
    """A mixture of experts (model/layers/moe.py): `num_experts` gated MLPs of
    `intermediate_size` each, `top_k` chosen a token by a router, their weights renormalized
    to sum to one where `norm_topk_prob`; a shared expert beside them (Qwen3-Next,
    Qwen3.5-MoE) of `shared_intermediate_size` (0: none) with a sigmoid gate."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class MlpSpec:
    kind: MlpKind
    activation: Activation
    intermediate_size: int  # a dense MLP's; a mixture's: each expert's
    moe: MoeSpec | None = None  # kind "moe": its experts


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    mlp: MlpSpec
    norm: NormKind
    eps: float
    # Gemma's sandwich: norms after attention and after the MLP as well as before each
    post_norms: bool = False


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder's layers, in order, and what surrounds them."""

    architecture: str  # the registry's name for it (HF `architectures` entry)
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    final_norm: NormKind
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False

    def kinds(self) -> set[AttentionKind]:
        return {layer.attention.kind for layer in self.layers}

    def is_plain_llama(self) -> "str | None":
        """None where every layer is the Llama layer the fused kernels and the C layer loop
        were written for (full attention with the rotary over the whole head, or one window on
        every layer, plain RMSNorms, a dense SiLU MLP, no soft-capping, gating or sandwich
        norms); else the first thing that differs, said for the start-up log."""
        if self.embed_scale is not None:
            return "scaled embeddings"
        if self.final_logit_softcap is not None:
            return "final logit soft-capping"
        if self.final_norm != "rms":
            return f"a {self.final_norm} final norm"
        windows = {layer.attention.window for layer in self.layers}
        for i, layer in enumerate(self.layers):
            a = layer.attention
            # one window on every layer is applied as a context cap by the engine: full attention
            capped = a.kind == "sliding" and len(windows) == 1
            why = (f"{a.kind} attention" if a.kind != "full" and not capped else
                   "partial rotary" if a.rope is None or a.rope.rotary_dim != a.head_dim else
                   "attention soft-capping" if a.logit_softcap is not None else
                   "an attention output gate" if a.output_gate else
                   f"a {layer.norm} norm" if layer.norm != "rms" else
                   "post-attention and post-MLP norms" if layer.post_norms else
                   f"a {layer.mlp.kind} MLP" if layer.mlp.kind != "dense" else
                   f"the {layer.mlp.activation} activation" if layer.mlp.activation != "silu" else None)
            if why is not None:
                return f"layer {i}: {why}"
        return None
