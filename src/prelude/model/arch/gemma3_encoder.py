"""Gemma 3 as a bidirectional encoder (EmbeddingGemma): a `Gemma3TextModel` trunk whose
config sets `use_bidirectional_attention`. Its layers are Gemma 3's (model/arch/gemma3.py)
with attention that looks both ways: a full layer sees the whole row, a sliding layer
`sliding_window // 2` tokens on either side (as transformers masks it). Like BERT it keeps
no KV and serves OneShot work only (embeddings, through the folder's sentence-transformers
modules); it has no language-model head.

A `Gemma3TextModel` without the flag is the causal trunk (a last-token embedder), served by
the decoder.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from prelude.model.arch import gemma3
from prelude.model.arch.gemma3 import Gemma3Config, Gemma3ForCausalLM
from prelude.model.attention.bidirectional import BidirectionalAttention
from prelude.model.attention.metadata import AttentionMetadata
from prelude.model.base import Architecture, EncoderWithoutKV, KVCaches

logger = logging.getLogger("prelude.model.gemma3_encoder")


class Gemma3Encoder(EncoderWithoutKV, Gemma3ForCausalLM):
    is_encoder = True
    computes_read_positions = False  # bidirectional: every layer reads every position
    default_pooling = "mean"  # EmbeddingGemma's; a folder's Pooling module says its own

    def __init__(self, config: Gemma3Config, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", *args: Any, **kwargs: Any) -> None:
        kwargs.pop("attention", None)  # the configured backend is causal and paged: not this model's
        super().__init__(config, weights, dtype, device, *args, **kwargs)
        # Gemma 3's layers call the backend for full layers and the windowed one for sliding layers
        self._bidirectional = BidirectionalAttention()
        self.attention = self._windowed = self._bidirectional  # type: ignore[assignment]
        self._no_kv: KVCaches = [(torch.empty(0), torch.empty(0))] * config.num_hidden_layers
        sliding = config.layer_kinds.count("sliding")
        logger.info("%s: a bidirectional encoder (use_bidirectional_attention): %d full layers see the whole "
                    "prompt, %d sliding ones %d tokens on either side; no KV, every request OneShot",
                    config.architecture, len(config.layer_kinds) - sliding, sliding, config.window // 2)

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row (a `meta.prefills` slice, a whole prompt) attends both ways within
        itself; returns the final-normed hidden states [T, H]. `kv_caches` is empty."""
        try:
            return super().forward(input_ids, positions, meta, self._no_kv)
        finally:
            self._bidirectional.release()


def _build(config: Gemma3Config, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
           **kwargs: Any) -> Gemma3ForCausalLM:
    """The encoder for a bidirectional trunk, the decoder for a causal one."""
    model_class = Gemma3Encoder if config.bidirectional else Gemma3ForCausalLM
    return model_class(config, weights, dtype, device, **kwargs)


ARCHITECTURES = tuple((Architecture(name, "gemma3_encoder", gemma3._config, _build), ())
                      for name in gemma3.ENCODER_ARCHITECTURES)
