"""Qwen3-MoE: the Qwen3 layer (q/k norms) whose MLP is a mixture of experts
(model/layers/moe.py) on every `decoder_sparse_step`-th layer not in `mlp_only_layers`;
the other layers keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from prelude.config import ModelConfig
from prelude.model.arch.llama import decoder_config, describe
from prelude.model.arch.qwen2 import sliding_layers_refused
from prelude.model.base import Architecture, UnsupportedCheckpoint
from prelude.model.decoder import Decoder
from prelude.model.spec import DecoderSpec, MlpSpec, MoeSpec

# The config fields of a mixture this file computes (hf_config.NUMERIC_FIELDS)
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")


def num_experts(raw: dict[str, Any]) -> int:
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def expert_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """The layers whose MLP is the mixture, as transformers chooses them: every
    `decoder_sparse_step`-th (counting from one) outside `mlp_only_layers`."""
    if num_experts(raw) == 0:
        return ()
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return tuple(i for i in range(int(raw["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)


def moe_spec(name: str, raw: dict[str, Any], shared_intermediate_size: int = 0) -> MoeSpec:
    experts, top_k = num_experts(raw), int(raw.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise UnsupportedCheckpoint(f"architecture {name}: num_experts_per_tok={top_k} of {experts} experts")
    return MoeSpec(experts, top_k, bool(raw.get("norm_topk_prob", False)), shared_intermediate_size)


def with_experts(spec: DecoderSpec, layers: tuple[int, ...], moe: MoeSpec, intermediate_size: int) -> DecoderSpec:
    """`spec` with the MLP of `layers` a mixture of `moe`'s experts of `intermediate_size`."""
    return replace(spec, layers=tuple(
        replace(layer, mlp=MlpSpec("moe", layer.mlp.activation, intermediate_size, moe)) if i in layers else layer
        for i, layer in enumerate(spec.layers)))


@dataclass(frozen=True)
class MoeModelConfig(ModelConfig):
    """A decoder config with its experts (`expert_layers` says which layers hold them)."""

    moe: MoeSpec | None = None
    moe_intermediate_size: int = 0

    @staticmethod
    def of(config: ModelConfig, moe: MoeSpec | None, moe_intermediate_size: int,
           layers: tuple[int, ...]) -> "MoeModelConfig":
        base = {f.name: getattr(config, f.name) for f in fields(ModelConfig)}
        return MoeModelConfig(**{**base, "expert_layers": layers}, moe=moe,
                              moe_intermediate_size=moe_intermediate_size)


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> MoeModelConfig:
    name = str((raw.get("architectures") or ["Qwen3MoeForCausalLM"])[0])
    sliding_layers_refused(name, raw)
    layers = expert_layers(raw)
    moe = moe_spec(name, raw) if layers else None
    config = decoder_config(name, {**raw, "sliding_window": None}, handled=MOE_FIELDS)
    return MoeModelConfig.of(config, moe, int(raw.get("moe_intermediate_size") or 0), layers)


class Qwen3MoeForCausalLM(Decoder):
    def __init__(self, config: MoeModelConfig, weights: Any, *args: Any, **kwargs: Any) -> None:
        spec = describe(config, qk_norm=True)
        if config.moe is not None:
            spec = with_experts(spec, config.expert_layers, config.moe, config.moe_intermediate_size)
        super().__init__(config, spec, weights, *args, **kwargs)


ARCHITECTURES = tuple(
    (Architecture(name, "qwen3_moe", _config, Qwen3MoeForCausalLM,
                  gguf=("qwen3moe",) if name == "Qwen3MoeForCausalLM" else ()), types)
    for name, types in (("Qwen3MoeForCausalLM", ("qwen3_moe",)), ("Qwen3MoeForSequenceClassification", ()))
)
