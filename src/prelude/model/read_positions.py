"""The positions of a forward whose final hidden states the heads read (executor/read_rows.py
finds them; a decoder computes its last layer for those alone). Apart from model/base.py:
it names the LoRA step, which the model kinds' shared protocol does not need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from prelude.model.lora.adapters import LoraStep


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
