"""The typed unit of work the scheduler hands the executor each step, and what comes back.

A leaf module (it imports only `prelude.params`): the engine builds these values and the
executor consumes them, and neither imports the other's internals through them.

The batch type tells the executor the lifetime contract before it launches anything:
a `DecodeBatch` holds one new token per running sequence; a `MixedBatch` holds prompt
chunks (possibly alongside decode rows). Both keep KV in paged blocks owned by the
requests. A `OneShotBatch` holds whole prompts of fixed-output requests: no block
tables, no KV written to the pool, nothing kept after the forward. A `MixedBatch` may
carry such OneShot rows too (fused steps): they ride in the same forward under the same
contract, their K/V temporaries of that forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prelude.params import LoraRequest, PoolingParams, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class SampleSpec:
    """How to pick the next token of a row whose last computed token is the sequence's last."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's sampling seed; the sampler mixes it with the output position, so a
    # token depends only on (seed, position, distribution): reproducible on any device,
    # with or without CUDA graphs, whatever else shares the batch.
    seed: int = 0
    # Structured outputs: the tokens allowed next, as a numpy int32 bitmask [ceil(V/32)]
    # (bit i of word w allows token 32w + i); None: unconstrained.
    token_bitmask: Any = None
    # Carried tokens (decode overlap): sampled by the step in flight before this one, not in
    # output_token_ids yet (not on the host), counted in the output position.
    carried: int = 0

    @property
    def position(self) -> int:
        """The output position of the token drawn (what the seed is mixed with)."""
        return len(self.output_token_ids) + self.carried


@dataclass(frozen=True)
class HeadSpec:
    """Fixed-size outputs computed from a whole prompt's hidden states."""

    prompt_logprobs: int | None = None
    pooling: PoolingParams | None = None
    # Mean/max pooling of a prompt that runs in chunks: the running pool of its earlier
    # chunks (count, sums, maxima: model/layers/pooler.py), and whether this row is itself
    # such a chunk (it returns the running pool instead of the embedding)
    pooled_before: tuple[float, ...] | None = None
    pool_chunk: bool = False


@dataclass(frozen=True)
class BatchRow:
    request_id: str
    token_ids: list[int]  # tokens computed this step
    start_pos: int  # absolute position of token_ids[0]
    block_table: list[int]  # covers start_pos + len(token_ids) tokens
    sample: SampleSpec | None  # None: a prompt chunk that does not finish the prompt
    head: HeadSpec | None = None  # only on rows holding a whole prompt (forced-Paged ablation)
    lora: LoraRequest | None = None  # the row's adapter (None: the base model)
    # Models with recurrent layers: the request's slot of the state pool, which the row's
    # tokens continue (start_pos 0: from a zero state); None: the model has no such layers.
    state_slot: int | None = None
    # A prefix-cache hit's state checkpoint the row starts from instead (its first row only)
    restore_slot: int | None = None
    # A hit ending inside a block (first row only): the cached block whose first
    # start_pos % block_size slots are copied into the row's block at start_pos before it runs
    copy_from: int | None = None
    # State checkpoints the row writes: (absolute position, checkpoint slot), the state
    # after the first `position` tokens of the sequence
    state_saves: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class OneShotRow:
    """A prompt computed in one forward; the request keeps nothing after it.

    With a prefix-cache hit, only tokens [num_cached, n) are computed and attend to the
    cached `prefix_blocks` (pinned for this step only). `publish_blocks` receive the K/V
    of the row's own full prompt blocks and then belong to the prefix cache.

    A hit may end inside a block (token-granular reuse): then `copy_from` is a cached
    block whose first num_cached % block_size slots hold this prompt's tokens there; the
    executor copies those slots into publish_blocks[0] (this row's own copy of that
    block) before the forward, and the block's remaining tokens are computed into it.
    """

    request_id: str
    token_ids: list[int]  # the whole prompt
    sample: SampleSpec | None  # the one generated token, if any
    head: HeadSpec | None
    num_cached: int = 0
    prefix_blocks: tuple[int, ...] = ()
    publish_blocks: tuple[int, ...] = ()
    # Multi-item packing: token_ids = a shared part, then items of these lengths. Each
    # item sees the shared part and itself only, at positions restarting after the shared
    # part; only the shared part is looked up in and published to the prefix cache.
    item_lens: tuple[int, ...] = ()
    lora: LoraRequest | None = None  # the row's adapter (None: the base model)
    copy_from: int | None = None  # a hit ending inside a block: the cached block to copy from
    # Models with recurrent layers: the checkpoint of the state after the cached prefix
    # (num_cached > 0 needs one), and the checkpoints the row writes out of its scratch
    # state: (absolute position within the shared part, checkpoint slot)
    restore_slot: int | None = None
    state_saves: tuple[tuple[int, int], ...] = ()

    @property
    def shared_len(self) -> int:
        return len(self.token_ids) - sum(self.item_lens)


@dataclass(frozen=True)
class OneShotBatch:
    rows: tuple[OneShotRow, ...]


@dataclass(frozen=True)
class DecodeBatch:
    rows: tuple[BatchRow, ...]


@dataclass(frozen=True)
class MixedBatch:
    prefill_rows: tuple[BatchRow, ...]
    decode_rows: tuple[BatchRow, ...]
    # Fused steps: OneShot rows computed in the same forward as the paged rows. They own
    # no KV and no block table; their outputs are what a OneShotBatch would give them.
    oneshot_rows: tuple[OneShotRow, ...] = ()

    @property
    def rows(self) -> tuple[BatchRow, ...]:
        """The paged rows (prompt chunks, then decodes); `oneshot_rows` are apart."""
        return self.prefill_rows + self.decode_rows


ForwardBatch = OneShotBatch | DecodeBatch | MixedBatch


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class HeadOutput:
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None
    scores: list[float] | None = None
    pooled: list[float] | None = None  # a chunk's running pool (HeadSpec.pool_chunk)


@dataclass(frozen=True)
class BatchOutput:
    sampled: dict[str, SampledToken]  # request_id -> token, for rows with a SampleSpec
    heads: dict[str, HeadOutput] = field(default_factory=dict)  # request_id -> head outputs
