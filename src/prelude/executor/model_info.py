"""What the engine may know of the model: a frozen summary, no model class."""

from __future__ import annotations

from dataclasses import dataclass

from prelude.params import EmbedSetup


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int  # rows of the LM head (may exceed the tokenizer's table: padded vocabularies)
    hidden_size: int
    max_positions: int  # positions the model can encode (rotary table / position embeddings)
    max_position_embeddings: int  # the checkpoint's declared context length
    sliding_window: int | None
    kv_bytes_per_block: int  # at the runner's block size, every layer, K and V
    labels: tuple[str, ...]  # classification head outputs; empty without a head
    can_generate: bool
    is_encoder: bool
    default_pooling: str
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    embed: EmbedSetup  # what its embeddings are (prompts, size, Matryoshka sizes)
    score_template: str | None = None  # a token reranker's prompt template for the score routes
    # a decoder's classification head reads the last token that is not this one (transformers')
    classify_pad_id: int | None = None
    # Models with recurrent (linear-attention) layers: one sequence's state in bytes (0: none)
    state_bytes_per_slot: int = 0
    # Models with sliding-window layers beside global ones: the window (tokens) and those
    # layers' share of kv_bytes_per_block, which a pool of their own can hold (0: none)
    kv_window: int = 0
    window_kv_bytes_per_block: int = 0
