"""What one forward pass needs to know to write and read the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PrefillSlice:
    """One row whose query holds several tokens (a prompt chunk).

    The row's queries are tokens [query_start, query_start + query_len) of the flattened
    batch; they sit at positions [context_len - query_len, context_len) of the sequence.
    """

    query_start: int
    query_len: int
    context_len: int  # tokens of the sequence whose KV exists after this step's write
    block_table: torch.Tensor  # [num_blocks] int64, covers context_len tokens
    # False for OneShot rows: only the cached prefix (context_len - query_len tokens) is in
    # the cache; the row's own K/V are this forward's temporaries.
    own_kv_in_cache: bool = True
    # The row's new tokens carry segment ids (AttentionMetadata.segment_ids) other than 0.
    segmented: bool = False


@dataclass(frozen=True)
class DecodeRows:
    """Rows with exactly one query token, attended in one batched gather."""

    query_index: torch.Tensor  # [B] positions of the rows in the flattened batch
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [B] int64
    max_context_len: int
    # False where max_context_len only bounds the rows (a replayed graph's static buffers
    # span the model's whole length): then even a single row's keys need a mask
    max_is_a_row_len: bool = True


@dataclass(frozen=True)
class PrefillTensors:
    """The prefill slices again, as device tensors built by the runner in the step's one
    host-to-device copy: what batched kernels (Triton) read without touching the host."""

    query_start: torch.Tensor  # [R] int64
    query_lens: torch.Tensor  # [R] int64
    context_lens: torch.Tensor  # [R] int64
    own_kv_in_cache: torch.Tensor  # [R] int64 (0/1)
    block_tables: torch.Tensor  # [R, max_blocks] int64, padded with block 0
    max_query_len: int


@dataclass(frozen=True)
class StateRow:
    """One row of a model with recurrent (linear-attention) layers, as those layers see it:
    tokens [start, start + length) of the flattened batch continue the state in `slot` of
    the state pool, or, with slot -1 (a OneShot row), a state of this forward's scratch
    that starts from zero and is dropped after it. `fresh`: the sequence starts here
    (the state starts from zero, whatever the slot held)."""

    start: int
    length: int
    slot: int
    fresh: bool
    # Packed items (multi-item scoring, OneShot only): the row's last tokens are items of
    # these lengths, each continuing the state at the shared part's end on its own
    items: tuple[int, ...] = ()
    # A prefix-cache hit: the row starts from the state in this slot (a checkpoint) instead
    # of its own slot's or zeros (-1: none)
    restore: int = -1
    # Checkpoints: (tokens into the row, slot) - the state after that many of the row's
    # tokens is copied to that slot, in increasing order, within the shared part. No row
    # restores a slot another row of the step saves: the rows stay independent.
    saves: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class StateRows:
    """The step's rows for the recurrent layers: `rows` (prompt chunks, OneShot prompts,
    packed items) and the decode rows `step_tokens` / `step_slots` [B], one token each
    continuing its slot's state in place. The CPU kernel and CUDA's varlen kernels take
    them all in one call per layer.

    `taps`: flattened token indices (ascending) after which every linear layer's state
    (conv, recurrent) is also wanted, e.g. a prefix checkpoint at a block boundary inside a
    OneShot prompt; the forward appends one (conv [m, C, K - 1], recurrent [m, Hv, dk, dv])
    pair per linear layer, in layer order, to `tapped`."""

    rows: tuple[StateRow, ...]
    step_tokens: torch.Tensor | None = None
    step_slots: torch.Tensor | None = None
    # Checkpoints of decode rows: (slot, checkpoint slot) copied after the step
    step_saves: tuple[tuple[int, int], ...] = ()
    taps: tuple[int, ...] = ()
    tapped: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, compare=False, repr=False)


@dataclass(frozen=True)
class AttentionMetadata:
    # [T] int64: cache slot (block * block_size + offset) of each new token, -1 for a token
    # whose K/V are not kept; None when nothing is written (a OneShot forward).
    slot_mapping: torch.Tensor | None
    prefills: tuple[PrefillSlice, ...]
    decodes: DecodeRows | None
    block_size: int
    # Indices of the tokens whose K/V are kept (slot >= 0), computed on the host so that no
    # backend has to look at the slots to find them (a host sync on a GPU); None: all kept.
    kept_tokens: torch.Tensor | None = None
    prefill_tensors: PrefillTensors | None = None  # set by the runner; None: build from `prefills`
    # [T] int64 over the flattened batch, or None: no row is segmented. Multi-item scoring:
    # segment 0 is shared; a new token of segment s > 0 sees the cached prefix, the
    # segment-0 new tokens of its row and, causally, the tokens of its own segment only.
    # Cached-prefix keys count as segment 0. Causality follows the tokens' order in the
    # row, not their (restarted) RoPE positions. The Triton prefill kernel takes the same ids.
    segment_ids: torch.Tensor | None = None
    # Models with recurrent layers: which state each row continues (None: no such layers)
    states: StateRows | None = None
    # Models whose sliding-window layers keep their K/V in a pool of their own: those
    # layers' metadata (the same rows over the window pool's slots and tables, whose
    # entries before a row's window are never read); None: every layer reads this one.
    window: AttentionMetadata | None = None
