"""What the executor needs from any model kind: one forward signature for decoders and
encoders, heads that project only the rows asked for, and the KV layout it allocates."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from prelude.config import Populate
from prelude.model.attention.metadata import AttentionMetadata

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class Model(Protocol):
    config: Any
    dtype: torch.dtype
    device: torch.device
    is_encoder: bool
    default_pooling: str
    # forward(..., reads=read_positions.ReadPositions) computes the last layer for those positions only
    computes_read_positions: bool

    @property
    def can_generate(self) -> bool: ...

    @property
    def max_positions(self) -> int:
        """Positions the model can encode (rotary table or learned position embeddings)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flattened rows [T] -> hidden states [T, H]; `meta.prefills` delimits the rows."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_limit: int | None) -> torch.Tensor | None:
        """The argmax of `compute_logits(hidden)` below `vocab_limit` per row, int64 [R], where
        the model finds it without the logits; None: the caller takes the logits."""
        ...

    def compute_label_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the given vocabulary ids only (a gather of the head's rows)."""
        ...

    def classify(self, hidden_row: torch.Tensor) -> torch.Tensor: ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int, populate: Populate = "off") -> KVCaches: ...

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def make_packed_copies(self) -> int:
        """Make now the prepacked weight copies that the model's first calls would make;
        how many (ExecutorConfig.pack_at_start)."""
        ...
