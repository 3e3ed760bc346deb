"""What the executor needs from any model kind: one forward signature for decoders and
encoders, heads that project only the rows asked for, and the KV layout it allocates."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from prelude.config import Populate
from prelude.kernels.ggml_quants import GgmlQuants
from prelude.model.attention.metadata import AttentionMetadata

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class UnsupportedCheckpoint(ValueError):
    """A checkpoint this engine cannot compute exactly (an unknown architecture, a config
    field it would ignore, weights it would leave unread): refused at start, in one line."""


class DerivedTensors(Protocol):
    """What a build derives from its checkpoint (casts, stacks, packed copies), by key: kept
    between starts by model/loading/prepared.py, or made every time (NothingKept)."""

    path: Path | None

    def tensor(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def blocks(self, key: str, make: Callable[[], GgmlQuants | None]) -> GgmlQuants | None: ...


class NothingKept:
    """Derived tensors made on every build, none kept."""

    path: Path | None = None

    def tensor(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        return make()

    def blocks(self, key: str, make: Callable[[], GgmlQuants | None]) -> GgmlQuants | None:
        return make()


class EncoderWithoutKV:
    """What an encoder answers where a decoder has a language-model head and KV: it has
    neither (every request is one OneShot forward that keeps nothing)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder model has no language-model head")

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_limit: int | None) -> torch.Tensor | None:
        raise RuntimeError("an encoder model has no language-model head")

    def compute_label_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder model has no language-model head")

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          populate: Populate = "off") -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 1


@dataclass(frozen=True)
class Architecture:
    """One name a checkpoint gives its architecture (HF `architectures`), and what serves it.
    `config_from_hf(raw, model_dir)` reads and checks the config (UnsupportedCheckpoint for
    what it cannot compute); `build(config, weights, dtype, device, attention, max_positions,
    prepack, blocks, prepared)` makes the model. `gguf`: llama.cpp's names for it
    (`general.architecture`)."""

    name: str
    family: str  # the architecture file (model/arch/<family>.py)
    config_from_hf: Callable[..., Any]
    build: Callable[..., "Model"]
    gguf: tuple[str, ...] = ()


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
