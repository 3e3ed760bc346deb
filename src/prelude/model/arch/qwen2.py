"""Qwen2: the Llama layer with biases on q, k and v (always, without a config flag)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prelude.config import ModelConfig
from prelude.model.arch.llama import decoder_config, describe
from prelude.model.base import Architecture, UnsupportedCheckpoint
from prelude.model.decoder import Decoder


def sliding_layers_refused(name: str, raw: dict[str, Any]) -> None:
    """Qwen2/Qwen3 slide a window on the layers from `max_window_layers` on where
    `use_sliding_window` is set: per-layer attention kinds, which these files do not compute."""
    if raw.get("use_sliding_window") and int(raw.get("max_window_layers", 0)) < int(raw["num_hidden_layers"]):
        raise UnsupportedCheckpoint(f"architecture {name}: config field use_sliding_window=True with "
                                    f"max_window_layers={raw.get('max_window_layers')} (sliding layers) is not supported")


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> ModelConfig:
    name = str((raw.get("architectures") or ["Qwen2ForCausalLM"])[0])
    sliding_layers_refused(name, raw)
    return decoder_config(name, {**raw, "sliding_window": None})


class Qwen2ForCausalLM(Decoder):
    def __init__(self, config: ModelConfig, weights: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, describe(config, qkv_bias=True), weights, *args, **kwargs)


ARCHITECTURES = tuple(
    (Architecture(name, "qwen2", _config, Qwen2ForCausalLM, gguf=("qwen2",) if name == "Qwen2ForCausalLM" else ()), types)
    for name, types in (("Qwen2ForCausalLM", ("qwen2",)), ("Qwen2ForSequenceClassification", ()), ("Qwen2Model", ()))
)
