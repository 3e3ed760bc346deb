"""One registry of model kinds: a checkpoint's config picks the builder, every builder
returns a `Model` with the same forward signature. The engine never sees these classes."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from prelude.config import ModelConfig
from prelude.model.attention import AttentionBackend
from prelude.model.base import Model
from prelude.model.encoder import BertEncoder, EncoderConfig
from prelude.model.ggml_blocks import GgmlBlocks
from prelude.model.llama import LlamaForCausalLM
from prelude.model.prepared import PreparedTensors

Blocks = Mapping[str, GgmlBlocks]
ModelBuilder = Callable[
    [Any, dict[str, torch.Tensor], torch.dtype, torch.device, AttentionBackend, int | None, bool, Blocks,
     PreparedTensors | None], Model
]


def _decoder(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
             attention: AttentionBackend, max_positions: int | None, prepack: bool, blocks: Blocks,
             prepared: PreparedTensors | None) -> Model:
    return LlamaForCausalLM(config, weights, dtype, device, attention=attention, max_positions=max_positions,
                            prepack=prepack, blocks=blocks, prepared=prepared)


def _encoder(config: EncoderConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
             attention: AttentionBackend, max_positions: int | None, prepack: bool, blocks: Blocks,
             prepared: PreparedTensors | None) -> Model:
    return BertEncoder(config, weights, dtype, device)  # bidirectional, no paged KV: no backend


MODEL_KINDS: dict[type, ModelBuilder] = {ModelConfig: _decoder, EncoderConfig: _encoder}


def build_model(
    config: ModelConfig | EncoderConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionBackend,
    max_positions: int | None = None,
    prepack: bool = True,
    blocks: Blocks | None = None,
    prepared: PreparedTensors | None = None,
) -> Model:
    """`prepack`: let the model use its CPU fast paths for projections (oneDNN-prepacked
    weights, GGUF blocks for decode: model/linear.py); False keeps plain weights only (what
    compiled segments take). `blocks`: a GGUF's block-format projections by HF name.
    `prepared`: what an earlier start derived from these weights (model/prepared.py)."""
    try:
        builder = MODEL_KINDS[type(config)]
    except KeyError:
        raise ValueError(f"no model kind for config {type(config).__name__}") from None
    return builder(config, weights, dtype, device, attention, max_positions, prepack, blocks or {}, prepared)
