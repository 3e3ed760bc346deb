"""What the executor needs from any model kind: one forward signature for decoders and
encoders, heads that project only the rows asked for, and the KV layout it allocates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from prelude.model.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from prelude.model.lora import LoraStep

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ReadPositions:
    """The positions of a forward whose final hidden states the heads read. A decoder
    given these computes its last layer's attention, MLP and final norm for them only
    (its K/V still for every token) and returns their hidden states alone, in this order."""

    index: torch.Tensor  # [K] int64: positions in the flattened batch, ascending
    # [prefill rows] int64, in `AttentionMetadata.prefills` order: how many of each row's
    # last queries the last layer attends (its first read position to its end)
    tail_queries: torch.Tensor
    # A forward with adapters: the read rows' adapters for the last layer's o_proj and MLP
    # (None: every read row is the base model's)
    lora: "LoraStep | None" = None


class Model(Protocol):
    config: Any
    dtype: torch.dtype
    device: torch.device
    is_encoder: bool
    default_pooling: str
    # forward(..., reads=ReadPositions) computes the last layer for those positions only
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

    def compute_label_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the given vocabulary ids only (a gather of the head's rows)."""
        ...

    def classify(self, hidden_row: torch.Tensor) -> torch.Tensor: ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCaches: ...

    def kv_bytes_per_block(self, block_size: int) -> int: ...
