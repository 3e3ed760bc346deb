"""Label heads over a OneShot row's hidden states: label-token scores at the prompt's end
or at each item's end (multi-item prompts), and whole-sequence logprobs of items.

Only the rows that matter are projected: the last token of the prompt (or of each item)
for label scores, and for sequence logprobs the shared part's last token plus every item
token but the last. With `label_softmax`, the projection is a gather of the label rows
of the LM head: a softmax restricted to the labels needs no full-vocabulary normalizer.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Sequence

import torch

from prelude.params import PoolingParams

Project = Callable[[torch.Tensor], torch.Tensor]  # [R, H] -> [R, V] float32 logits
ProjectIds = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # ([R, H], ids [K]) -> [R, K]


def item_bounds(suffix_len: int, item_lens: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each item within the computed suffix of its row (the items
    come last; the shared part's computed rest comes first)."""
    first = suffix_len - sum(item_lens)
    ends = list(accumulate(item_lens, initial=first))
    return list(zip(ends[:-1], ends[1:]))


def score_rows(suffix_len: int, pooling: PoolingParams) -> list[int]:
    """Rows of the suffix whose next-token distribution gives label scores: the last one,
    or each item's last one."""
    if not pooling.item_lens:
        return [suffix_len - 1]
    return [end - 1 for _, end in item_bounds(suffix_len, pooling.item_lens)]


def label_scores(
    hidden_rows: torch.Tensor, label_ids: torch.Tensor, label_softmax: bool, project: Project, project_ids: ProjectIds
) -> torch.Tensor:
    """[R, H] -> [R, K] log-probabilities of the label ids: over the labels only
    (`label_softmax`, from the gathered head rows) or over the whole vocabulary."""
    if label_softmax:
        return torch.log_softmax(project_ids(hidden_rows, label_ids).float(), dim=-1)
    return torch.log_softmax(project(hidden_rows).float(), dim=-1).index_select(1, label_ids)


def sequence_rows(suffix_tokens: Sequence[int], item_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """(predictor rows, target tokens) of teacher-forced item logprobs: an item's first
    token is predicted by the shared part's last row, each later one by the item token
    before it (its own segment)."""
    bounds = item_bounds(len(suffix_tokens), item_lens)
    shared_last = bounds[0][0] - 1
    if shared_last < 0:
        raise ValueError("the shared part's last token must be computed in the row")
    rows: list[int] = []
    targets: list[int] = []
    for start, end in bounds:
        rows.extend([shared_last, *range(start, end - 1)])
        targets.extend(suffix_tokens[start:end])
    return rows, targets


def sequence_logprobs(
    hidden_rows: torch.Tensor, targets: torch.Tensor, item_lens: Sequence[int], project: Project, chunk: int = 512
) -> torch.Tensor:
    """Sum of each item's token logprobs ([num_items], float32) from the predictor rows'
    hidden states [R, H] (ordered as `sequence_rows` returns them)."""
    picked = []
    for lo in range(0, hidden_rows.shape[0], chunk):
        lp = torch.log_softmax(project(hidden_rows[lo : lo + chunk]).float(), dim=-1)
        picked.append(lp.gather(1, targets[lo : lo + chunk].unsqueeze(1)).squeeze(1))
    per_token = torch.cat(picked)
    return torch.stack([part.sum() for part in per_token.split(list(item_lens))])
