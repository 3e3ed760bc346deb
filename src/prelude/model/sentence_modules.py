"""A sentence-transformers folder's modules, read once at start for any backbone the
registry serves (BERT encoders and decoders alike): `modules.json` naming the trunk
(`Transformer`), then `Pooling`, `Dense` layers and `Normalize`; the prompts of
`config_sentence_transformers.json`; the Matryoshka sizes a config declares.

A folder whose modules the engine would not compute exactly (a module kind it does not
know, a pooling mode it does not implement, a Dense layer whose size does not follow the
one before it) is refused in one line that names the module: served anyway, every vector
would differ from sentence-transformers'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from prelude.model.base import UnsupportedCheckpoint

# sentence-transformers' pooling modes -> Prelude's names (the ones implemented)
POOLING_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls", "max": "max"}
# Its legacy boolean keys, in its concatenation order
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# A Dense layer's activation (the torch.nn class sentence-transformers names) -> ours
DENSE_ACTIVATIONS = {"Tanh": "tanh", "Identity": "identity", "GELU": "gelu", "ReLU": "relu", "Sigmoid": "sigmoid",
                     "SiLU": "silu"}


@dataclass(frozen=True)
class DenseModule:
    """One Dense layer: y = activation(x W^T + b)."""

    path: str  # its folder in the checkpoint (2_Dense), for messages
    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None
    activation: str  # a DENSE_ACTIVATIONS value


@dataclass(frozen=True)
class SentenceModules:
    """What comes after the trunk, as the folder declares it."""

    pooling: str  # last | mean | cls | max
    include_prompt: bool  # False: the prompt's tokens are left out of the pooled ones
    dense: tuple[DenseModule, ...]
    normalize: bool  # a Normalize module ends the stack
    prompts: tuple[tuple[str, str], ...]  # (name, text) from config_sentence_transformers.json
    default_prompt_name: str | None
    max_seq_length: int | None  # sentence_bert_config.json: sentence-transformers truncates there

    def dimension(self, hidden_size: int) -> int:
        return int(self.dense[-1].weight.shape[0]) if self.dense else hidden_size


def _refuse(model_dir: Path, what: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"sentence-transformers folder {model_dir.name}: {what}")


def _json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def pooling_of(model_dir: Path, config: Mapping[str, Any]) -> tuple[str, bool]:
    """(mode, include_prompt) of a Pooling module's config.json; refused where the mode (or
    a combination of modes) is not implemented."""
    modes: Any = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _LEGACY_MODES.items() if config.get(key)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1:
        raise _refuse(model_dir, f"pooling modes {'+'.join(modes)} (concatenated) are not implemented")
    if modes[0] not in POOLING_MODES:
        raise _refuse(model_dir, f"pooling mode {modes[0]!r} is not implemented (implemented: "
                                 f"{', '.join(POOLING_MODES)})")
    return POOLING_MODES[modes[0]], bool(config.get("include_prompt", True))


def _dense_tensors(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    bin_file = folder / "pytorch_model.bin"
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    return {}


def _dense(model_dir: Path, path: str, width: int) -> DenseModule:
    folder = model_dir / path
    cfg = _json(folder / "config.json")
    name = f"Dense module {path}"
    activation = str(cfg.get("activation_function") or "torch.nn.modules.activation.Tanh").rsplit(".", 1)[-1]
    if activation not in DENSE_ACTIVATIONS:
        raise _refuse(model_dir, f"{name}: activation {activation} is not implemented "
                                 f"(implemented: {', '.join(DENSE_ACTIVATIONS)})")
    if cfg.get("use_residual"):
        raise _refuse(model_dir, f"{name}: use_residual is not implemented")
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") not in ("sentence_embedding", None):
            raise _refuse(model_dir, f"{name}: {key}={cfg[key]!r} is not implemented")
    tensors = _dense_tensors(folder)
    weight = tensors.get("linear.weight")
    if weight is None:
        raise _refuse(model_dir, f"{name} has no linear.weight")
    has_bias = bool(cfg.get("bias", True))
    bias = tensors.get("linear.bias")
    out_f, in_f = int(cfg.get("out_features", weight.shape[0])), int(cfg.get("in_features", weight.shape[1]))
    if in_f != width or tuple(weight.shape) != (out_f, in_f):
        raise _refuse(model_dir, f"{name} maps {in_f} -> {out_f} features (weight {tuple(weight.shape)}), but its "
                                 f"input has {width}")
    if has_bias != (bias is not None) or (bias is not None and tuple(bias.shape) != (out_f,)):
        raise _refuse(model_dir, f"{name}: its bias does not match its config (bias={has_bias})")
    unread = sorted(set(tensors) - {"linear.weight", "linear.bias"})
    if unread:
        raise _refuse(model_dir, f"{name}: tensors {', '.join(unread[:3])} are not read")
    return DenseModule(path, weight.float(), None if bias is None else bias.float(), DENSE_ACTIVATIONS[activation])


def read_sentence_modules(model_dir: Path | None, hidden_size: int) -> SentenceModules | None:
    """The modules of a sentence-transformers folder, checked against the trunk's
    `hidden_size`; None where the folder has no modules.json."""
    if model_dir is None or not (model_dir / "modules.json").is_file():
        return None
    with open(model_dir / "modules.json", encoding="utf-8") as f:
        modules = json.load(f)
    pooling: tuple[str, bool] | None = None
    dense: list[DenseModule] = []
    normalize = False
    width = hidden_size
    for i, module in enumerate(sorted(modules, key=lambda m: int(m.get("idx", 0)))):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = str(module.get("path", ""))
        if kind not in ("Transformer", "Pooling", "Dense", "Normalize"):
            raise _refuse(model_dir, f"module {kind} ({path or 'the folder'}) is not implemented "
                                     "(implemented: Transformer, Pooling, Dense, Normalize)")
        if normalize:
            raise _refuse(model_dir, f"module {kind} ({path}) after Normalize is not implemented")
        if kind == "Transformer":
            if i != 0 or path not in ("", "."):
                raise _refuse(model_dir, "the Transformer module must come first, from the folder itself")
        elif kind == "Pooling":
            if pooling is not None or dense:
                raise _refuse(model_dir, f"Pooling module {path} after another Pooling or Dense is not implemented")
            cfg = _json(model_dir / path / "config.json")
            declared = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension", hidden_size))
            if int(declared) != hidden_size:
                raise _refuse(model_dir, f"Pooling module {path} pools {declared} features; the model has {hidden_size}")
            pooling = pooling_of(model_dir, cfg)
        elif kind == "Dense":
            if pooling is None:
                raise _refuse(model_dir, f"Dense module {path} before any Pooling is not implemented")
            dense.append(_dense(model_dir, path, width))
            width = int(dense[-1].weight.shape[0])
        else:
            normalize = True
    if pooling is None:
        raise _refuse(model_dir, "modules.json has no Pooling module")
    st_cfg = model_dir / "config_sentence_transformers.json"
    cfg = _json(st_cfg) if st_cfg.is_file() else {}
    prompts = {str(k): str(v) for k, v in (cfg.get("prompts") or {}).items()}
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise _refuse(model_dir, f"default_prompt_name {default!r} names no prompt (prompts: {', '.join(prompts)})")
    bert_cfg = model_dir / "sentence_bert_config.json"
    max_len = _json(bert_cfg).get("max_seq_length") if bert_cfg.is_file() else None
    return SentenceModules(pooling[0], pooling[1], tuple(dense), normalize, tuple(prompts.items()),
                           None if default is None else str(default), None if max_len is None else int(max_len))


def matryoshka_dimensions(config: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The sizes a checkpoint's config.json declares its vectors may be cut to
    (`matryoshka_dimensions`), () where it declares any size (`is_matryoshka`), None
    where it declares none."""
    dims = config.get("matryoshka_dimensions")
    if dims:
        return tuple(sorted(int(d) for d in dims))
    return () if config.get("is_matryoshka") else None
