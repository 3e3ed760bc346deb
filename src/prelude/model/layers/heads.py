"""Heads over a trunk's hidden states: only the rows asked for are projected.

Pure tensor functions; the executor turns their results into API payloads.
"""

from __future__ import annotations

from typing import Callable

import torch


def prompt_token_logprobs(
    project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, token_ids: list[int], k: int,
    chunk: int = 512,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprob of each prompt token given its prefix, from hidden states at positions 0..n-2.

    Logits are projected `chunk` rows at a time: a whole [n, V] float32 matrix would be
    ~1.6 GB for an 8K prompt and a 49K vocabulary.
    Returns (actual [n-1], rank [n-1], top values [n-1, k] or None, top ids [n-1, k] or None).
    """
    targets = torch.tensor(token_ids[1:], dtype=torch.long).to(hidden.device)
    actual, rank, vals, ids = [], [], [], []
    for lo in range(0, hidden.shape[0], chunk):
        lp = torch.log_softmax(project(hidden[lo : lo + chunk]).float(), dim=-1)
        a = lp.gather(1, targets[lo : lo + chunk].unsqueeze(1)).squeeze(1)
        actual.append(a)
        rank.append((lp > a.unsqueeze(1)).sum(-1) + 1)
        if k > 0:
            v, i = ordered_topk(lp, k)
            vals.append(v)
            ids.append(i)
    if k <= 0:
        return torch.cat(actual), torch.cat(rank), None, None
    return torch.cat(actual), torch.cat(rank), torch.cat(vals), torch.cat(ids)


def ordered_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [R, V] and their ids, in one total order: value
    descending, then id ascending. torch.topk orders exact ties as its kernel happens to, by
    the row count among others: bf16 logits tie often (8 bits of mantissa), and the same
    logits named other alternatives in a batch of another size. CPU only (the boundary
    check reads a count on the host); elsewhere, and on rows with NaN, torch.topk's order."""
    vals, ids = x.topk(k, dim=-1)
    if x.device.type != "cpu" or k == 0:
        return vals, ids
    ids, by_id = ids.sort(dim=-1)  # the chosen k by id, then stably by value
    vals = vals.gather(1, by_id)
    order = vals.argsort(dim=-1, descending=True, stable=True)
    vals, ids = vals.gather(1, order), ids.gather(1, order)
    # Rows where the k-th value ties beyond the k taken: topk picked among those ties, the
    # order wants their lowest ids (a topk over -id where tied, for those rows only).
    kth = vals[:, -1:]
    bad = ((x >= kth).sum(-1) > k).nonzero().flatten()
    if bad.numel():
        xb, kb, ib = x[bad], kth[bad], ids[bad]
        neg_ids = -torch.arange(x.shape[1], dtype=torch.float32).expand_as(xb)
        lowest = torch.where(xb == kb, neg_ids, float("-inf")).topk(k, dim=-1).indices  # tied ids, ascending
        above = (vals[bad] > kb).sum(-1, keepdim=True)  # the places before the tie keep their ids
        at = torch.arange(k).expand_as(ib)
        ids[bad] = torch.where(at >= above, lowest.gather(1, (at - above).clamp(min=0)), ib)
    return vals, ids

