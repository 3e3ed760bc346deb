"""A test-only architecture: the Llama layer with a GELU-tanh gated MLP, added as this one
file plus its registry entry, computed by the shared layers (the fused kernels and the C
layer loop say they do not run it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from prelude.config import ModelConfig
from prelude.model import registry
from prelude.model.arch import hf_config
from prelude.model.arch.llama import describe
from prelude.model.base import Architecture
from prelude.model.decoder import Decoder

NAME = "ToyGeluLlamaForCausalLM"


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> ModelConfig:
    hf_config.refuse_unhandled(NAME, raw)
    hf_config.require(NAME, raw, "hidden_act", ("gelu_pytorch_tanh",), None)
    theta, scaling = hf_config.rope_of(NAME, raw)
    config = ModelConfig.from_hf_dict(raw)
    return replace(config, architecture=NAME, rope_theta=theta, rope_scaling=scaling)


class ToyGeluLlamaForCausalLM(Decoder):
    def __init__(self, config: ModelConfig, weights: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, describe(config, activation="gelu_tanh"), weights, *args, **kwargs)


registry.register(Architecture(NAME, "toy_gelu_llama", _config, ToyGeluLlamaForCausalLM))
