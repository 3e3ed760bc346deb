"""Which positions of a step the output heads read, and where they land in the forward's
output when the decoder computes its last layer for those alone (model/read_positions.py's
`ReadPositions`).

A sampling row reads its last computed token; a classify/score head and last-token
pooling read it too; label scores read the last token of the prompt or of each
item. Prompt logprobs, mean/cls pooling and sequence logprobs read (nearly) every
position: such a row keeps all of its positions. A prompt chunk that does not finish its
prompt reads none. Everything else that the last layer would compute after its K/V is
never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from prelude.executor import label_heads
from prelude.executor.inputs import copy_int64
from prelude.forward_batch import HeadSpec, SampleSpec
from prelude.model.read_positions import ReadPositions
from prelude.params import PoolingTask

# The positions of a row's computed tokens that the heads read, ascending; None: every one.
RowRead = tuple[int, ...] | None


def row_read(num_tokens: int, sample: SampleSpec | None, head: HeadSpec | None, default_pooling: str) -> RowRead:
    """What OutputHeads reads of a row of `num_tokens` computed tokens."""
    read: set[int] = set()
    if sample is not None:
        read.add(num_tokens - 1)
    if head is not None:
        if head.prompt_logprobs is not None and num_tokens > 1:
            return None
        p = head.pooling
        if p is None:
            pass
        elif p.task is PoolingTask.LABELS:
            read.update(label_heads.score_rows(num_tokens, p))
        elif p.task is PoolingTask.CLASSIFY or (p.task is PoolingTask.EMBED
                                                and (p.pooling or default_pooling) == "last"):
            read.add(num_tokens - 1)
        else:  # sequence logprobs, mean or cls pooling
            return None
    return tuple(sorted(read))


def local_index(read: RowRead, position: int) -> int:
    """Where a row's computed position sits among its read rows."""
    return position if read is None else read.index(position)


@dataclass(frozen=True)
class StepReads:
    """A step's read positions: for the forward, and each row's start in its output."""

    positions: ReadPositions
    starts: list[int]  # each row's first row in the forward's output
    rows: list[RowRead]


def step_reads(device: torch.device, starts: Sequence[int], lens: Sequence[int], reads: Sequence[RowRead],
               prefill_starts: Sequence[int]) -> StepReads | None:
    """Rows at `starts` with `lens` computed tokens each and what is read of them; the
    prefill rows (the attention metadata's `prefills`) start at `prefill_starts`. None when
    every position is read: nothing to leave out."""
    index: list[int] = []
    out_starts: list[int] = []
    tail: dict[int, int] = {}  # row start -> its tokens from the first read one to its end
    for start, n, read in zip(starts, lens, reads, strict=True):
        out_starts.append(len(index))
        positions = range(n) if read is None else read
        index.extend(start + j for j in positions)
        tail[start] = n - positions[0] if len(positions) else 0
    if len(index) == sum(lens):
        return None
    d_index, d_tails = copy_int64(device, index, [tail[s] for s in prefill_starts])
    return StepReads(ReadPositions(d_index, d_tails), out_starts, list(reads))
