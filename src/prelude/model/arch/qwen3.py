"""Qwen3: the Llama layer with a per-head RMSNorm of q and k before the rotary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prelude.config import ModelConfig
from prelude.model.arch.llama import decoder_config, describe
from prelude.model.arch.qwen2 import sliding_layers_refused
from prelude.model.base import Architecture
from prelude.model.decoder import Decoder


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> ModelConfig:
    name = str((raw.get("architectures") or ["Qwen3ForCausalLM"])[0])
    sliding_layers_refused(name, raw)
    return decoder_config(name, {**raw, "sliding_window": None})


class Qwen3ForCausalLM(Decoder):
    def __init__(self, config: ModelConfig, weights: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, describe(config, qk_norm=True), weights, *args, **kwargs)


ARCHITECTURES = tuple(
    (Architecture(name, "qwen3", _config, Qwen3ForCausalLM, gguf=("qwen3",) if name == "Qwen3ForCausalLM" else ()), types)
    for name, types in (("Qwen3ForCausalLM", ("qwen3",)), ("Qwen3ForSequenceClassification", ()), ("Qwen3Model", ()))
)
