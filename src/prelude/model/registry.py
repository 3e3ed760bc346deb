"""The architectures this engine computes, by the checkpoint's own name for them: HF
`architectures` (`LlamaForCausalLM`, `Qwen3ForSequenceClassification`, ...) or GGUF
`general.architecture` (`llama`, `qwen3`, ...). Each names one model class in one
architecture file (model/arch/); anything else is refused at start in one line."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from prelude.kernels.ggml_quants import GgmlQuants
from prelude.model.arch import bert, gemma3, gemma3_encoder, llama, qwen2, qwen3, qwen3_5, qwen3_moe, qwen3_next
from prelude.model.attention import AttentionBackend
from prelude.model.base import Architecture, DerivedTensors, Model, UnsupportedCheckpoint

logger = logging.getLogger("prelude.model.registry")

_ARCHITECTURES: dict[str, Architecture] = {}
# model_type -> the architecture of a config that names none (configs built in code)
_BY_MODEL_TYPE: dict[str, str] = {}


def register(arch: Architecture, model_types: tuple[str, ...] = ()) -> None:
    """Admit `arch` under its name (and as the default of `model_types`)."""
    _ARCHITECTURES[arch.name] = arch
    for model_type in model_types:
        _BY_MODEL_TYPE.setdefault(model_type, arch.name)


for _family in (llama, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_next, gemma3, gemma3_encoder, bert):
    for _arch, _types in _family.ARCHITECTURES:
        register(_arch, _types)


def supported() -> list[str]:
    return sorted(_ARCHITECTURES)


def _refused(name: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"architecture {name} is not supported; supported: {', '.join(supported())}")


def lookup(name: str) -> Architecture:
    try:
        return _ARCHITECTURES[name]
    except KeyError:
        raise _refused(name) from None


def architecture_name(raw: Mapping[str, Any]) -> str:
    """The checkpoint's name for its architecture: the first of `architectures`, else the
    default of its `model_type`."""
    names = raw.get("architectures") or []
    if names:
        return str(names[0])
    model_type = str(raw.get("model_type", ""))
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise UnsupportedCheckpoint(f"config.json names no architecture and model_type {model_type!r} is not supported; "
                                f"supported: {', '.join(supported())}")


def architecture_of(raw: Mapping[str, Any]) -> Architecture:
    return lookup(architecture_name(raw))


def config_for(raw: Mapping[str, Any], model_dir: Path | None = None) -> Any:
    """The checked config of a HF `config.json` (UnsupportedCheckpoint in one line otherwise)."""
    arch = architecture_of(raw)
    return arch.config_from_hf(dict(raw), model_dir)


def gguf_architecture(gguf_name: str) -> Architecture:
    """The architecture a GGUF's `general.architecture` names."""
    for arch in _ARCHITECTURES.values():
        if gguf_name in arch.gguf:
            return arch
    gguf = sorted({g for a in _ARCHITECTURES.values() for g in a.gguf})
    raise UnsupportedCheckpoint(f"GGUF architecture {gguf_name!r} is not supported; supported: {', '.join(gguf)}")


def build_model(
    config: Any,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionBackend,
    max_positions: int | None = None,
    prepack: bool = True,
    blocks: Mapping[str, GgmlQuants] | None = None,
    prepared: DerivedTensors | None = None,
) -> Model:
    """The model of `config`'s architecture (config.architecture) over `weights`.
    `prepack`: let the model use its CPU fast paths for projections (prepacked weights, GGUF
    blocks for decode: model/layers/linear.py); False keeps plain weights only (what compiled
    segments take). `blocks`: a GGUF's block-format projections by HF name. `prepared`: what
    an earlier start derived from these weights (model/loading/prepared.py)."""
    arch = lookup(config.architecture)
    logger.info("architecture %s (model/arch/%s.py)", arch.name, arch.family)
    return arch.build(config, weights, dtype, device, attention=attention, max_positions=max_positions,
                      prepack=prepack, blocks=blocks or {}, prepared=prepared)
