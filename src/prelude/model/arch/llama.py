"""Llama and the checkpoints shaped like it (Mistral, SmolLM2): full attention with the
rotary over the whole head, RMSNorms, a SiLU-gated MLP; Mistral's sliding window covers
every layer, so the engine caps each request's context to it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from prelude.config import ModelConfig
from prelude.model.arch import hf_config
from prelude.model.base import Architecture
from prelude.model.decoder import Decoder
from prelude.model.spec import AttentionSpec, DecoderSpec, LayerSpec, MlpSpec, RopeSpec


def decoder_config(name: str, raw: dict[str, Any], handled: tuple[str, ...] = ()) -> ModelConfig:
    """The ModelConfig of a Llama-shaped `raw` config for architecture `name`: refused where
    it sets what this layer does not compute (another activation, per-layer attention kinds,
    experts, soft-capping ...), `handled` naming the fields the caller computes."""
    hf_config.refuse_unhandled(name, raw, handled)
    hf_config.require(name, raw, "hidden_act", ("silu",), "silu")
    theta, scaling = hf_config.rope_of(name, raw)
    config = ModelConfig.from_hf_dict(raw)
    return replace(config, architecture=name, rope_theta=theta, rope_scaling=scaling)


def describe(config: ModelConfig, *, qkv_bias: bool = False, qk_norm: bool = False,
             activation: str = "silu") -> DecoderSpec:
    """Every layer alike: full attention (or Mistral's one window), a dense gated MLP."""
    rope = RopeSpec(config.rope_theta, config.rope_scaling, config.head_dim)
    attention = AttentionSpec(
        kind="full" if config.sliding_window is None else "sliding", num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, rope=rope,
        scale=config.head_dim**-0.5, window=config.sliding_window, qkv_bias=qkv_bias, qk_norm=qk_norm)
    layer = LayerSpec(attention, MlpSpec("dense", activation, config.intermediate_size), "rms",  # type: ignore[arg-type]
                      config.rms_norm_eps)
    return DecoderSpec(config.architecture, config.hidden_size, config.vocab_size,
                       (layer,) * config.num_hidden_layers, "rms", tie_word_embeddings=config.tie_word_embeddings)


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> ModelConfig:
    name = str((raw.get("architectures") or ["LlamaForCausalLM"])[0])
    # Mistral's window is every layer's (the engine's context cap); Llama configs have none
    return decoder_config(name, raw, handled=("sliding_window",))


class LlamaForCausalLM(Decoder):
    def __init__(self, config: ModelConfig, weights: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, describe(config), weights, *args, **kwargs)


ARCHITECTURES = tuple(
    (Architecture(name, "llama", _config, LlamaForCausalLM, gguf=("llama",) if name == "LlamaForCausalLM" else ()), types)
    for name, types in (("LlamaForCausalLM", ("llama",)), ("LlamaForSequenceClassification", ()),
                        ("MistralForCausalLM", ("mistral",)), ("MistralForSequenceClassification", ()),
                        ("LlamaModel", ()), ("MistralModel", ()))
)
