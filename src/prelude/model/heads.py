"""Heads over a trunk's hidden states: only the rows asked for are projected.

Pure tensor functions; the executor turns their results into API payloads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, method: str) -> torch.Tensor:
    """[n, H] hidden states of one sequence -> [H] (float32)."""
    if method == "last":
        return hidden[-1].float()
    if method == "mean":
        return hidden.float().mean(0)
    if method == "cls":
        return hidden[0].float()
    raise ValueError(f"unknown pooling {method!r}")


def normalize(vec: torch.Tensor) -> torch.Tensor:
    return F.normalize(vec, p=2, dim=-1)


def prompt_token_logprobs(
    logits: torch.Tensor, token_ids: list[int], k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprob of each prompt token given its prefix, from logits at positions 0..n-2.

    Returns (actual [n-1], rank [n-1], top values [n-1, k] or None, top ids [n-1, k] or None).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(token_ids[1:], dtype=torch.long, device=lp.device)
    actual = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    rank = (lp > actual.unsqueeze(1)).sum(-1) + 1
    if k <= 0:
        return actual, rank, None, None
    vals, ids = lp.topk(k, dim=-1)
    return actual, rank, vals, ids


def label_logprobs(last_logits: torch.Tensor, label_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Next-token logprobs of each candidate label's first token after the prompt."""
    lp = torch.log_softmax(last_logits.float(), dim=-1)
    return lp[torch.tensor(label_token_ids, dtype=torch.long, device=lp.device)]
