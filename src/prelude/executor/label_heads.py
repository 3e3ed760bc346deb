"""Label heads over a OneShot row's hidden states: label-token scores at the prompt's end
or at each packed item's end, and whole-sequence logprobs of packed items.

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
    """[start, end) of each packed item within the computed suffix of its row (the items
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


def sequence_rows(
    suffix_tokens: Sequence[int], item_lens: Sequence[int], item_scored: Sequence[int] = (),
    item_next_ids: Sequence[Sequence[int]] = (),
) -> tuple[list[int], list[int], list[int]]:
    """(predictor rows, target tokens, group sizes) of teacher-forced item logprobs: a
    scored token is predicted by the row before it (the shared part's last row for an
    item's first token, else the item's own previous token: its own segment). Per item,
    one group holds its scored tokens (`item_scored`: its last k; default all), then one
    group of one per id in `item_next_ids`, predicted by the item's last row."""
    bounds = item_bounds(len(suffix_tokens), item_lens)
    shared_last = bounds[0][0] - 1
    rows: list[int] = []
    targets: list[int] = []
    groups: list[int] = []
    for i, (start, end) in enumerate(bounds):
        first = end - item_scored[i] if item_scored else start
        if first == start and shared_last < 0:
            raise ValueError("the shared part's last token must be computed in the row")
        rows.extend(shared_last if j == start else j - 1 for j in range(first, end))
        targets.extend(suffix_tokens[first:end])
        groups.append(end - first)
        for token in (item_next_ids[i] if item_next_ids else ()):
            rows.append(end - 1)
            targets.append(token)
            groups.append(1)
    return rows, targets, groups


def sequence_logprobs(
    hidden_rows: torch.Tensor, row_of: torch.Tensor, targets: torch.Tensor, groups: Sequence[int], project: Project,
    chunk: int = 512,
) -> torch.Tensor:
    """Sum of each group's token logprobs ([len(groups)], float32; an empty group: 0).
    `hidden_rows` [R, H]: the distinct predictor rows' hidden states, each projected once;
    `row_of` [T]: which of them predicts each target (ordered as `sequence_rows` returns)."""
    per_token = torch.zeros(targets.shape[0], dtype=torch.float32, device=targets.device)
    for lo in range(0, hidden_rows.shape[0], chunk):  # chunks bound the [rows, vocab] logits
        lp = torch.log_softmax(project(hidden_rows[lo : lo + chunk]).float(), dim=-1)
        at = ((row_of >= lo) & (row_of < lo + chunk)).nonzero().squeeze(1)
        per_token[at] = lp[row_of[at] - lo, targets[at]]
    return torch.stack([part.sum() for part in per_token.split(list(groups))])
