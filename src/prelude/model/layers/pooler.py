"""A sentence embedding from one sequence's hidden states: pooling (last token, mean, CLS,
max; the prompt's tokens left out where the folder says so), the folder's Dense layers,
a Matryoshka cut and the L2 normalization, in sentence-transformers' order."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from prelude.model.sentence_modules import DenseModule

_ACT = {"tanh": torch.tanh, "identity": lambda x: x, "gelu": F.gelu, "relu": F.relu, "sigmoid": torch.sigmoid,
        "silu": F.silu}


def pool(hidden: torch.Tensor, method: str, skip: int = 0) -> torch.Tensor:
    """[n, H] hidden states of one sequence -> [H] (float32). `skip`: leading tokens (a
    prompt) left out of the pooled ones; the last token always stays."""
    rest = hidden[min(skip, hidden.shape[0] - 1):]
    if method == "last":
        return rest[-1].float()
    if method == "mean":
        return rest.float().mean(0)
    if method == "cls":
        return rest[0].float()
    if method == "max":
        return rest.float().amax(0)
    raise ValueError(f"unknown pooling {method!r}")


def running_pool(hidden: torch.Tensor, skip: int, before: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk's contribution to a mean or max pool, added to `before`: [count, sums [H],
    maxima [H]] (float32), the rows from `skip` on; a running pool across chunks instead of
    a second pass over the whole sequence."""
    rows = hidden[skip:].float()
    width = hidden.shape[1]
    own = torch.cat([torch.tensor([float(rows.shape[0])], device=hidden.device), rows.sum(0),
                     rows.amax(0) if rows.shape[0] else torch.full((width,), float("-inf"), device=hidden.device)])
    if before is None:
        return own
    return torch.cat([own[: 1 + width] + before[: 1 + width], torch.maximum(own[1 + width:], before[1 + width:])])


def pooled_value(running: torch.Tensor, method: str) -> torch.Tensor:
    """The mean or max of a running pool."""
    width = (running.shape[0] - 1) // 2
    if method == "mean":
        return running[1 : 1 + width] / running[0].clamp(min=1.0)
    if method == "max":
        return running[1 + width:]
    raise ValueError(f"pooling {method!r} has no running form")


class Pooler:
    """The pooled head of a model: its Dense layers on its device, float32."""

    def __init__(self, dense: Sequence[DenseModule] = (), device: torch.device | str = "cpu") -> None:
        self.dense = [(d.weight.to(device=device, dtype=torch.float32),
                       None if d.bias is None else d.bias.to(device=device, dtype=torch.float32), _ACT[d.activation])
                      for d in dense]

    def __call__(self, hidden: torch.Tensor, method: str, skip: int = 0, dimensions: int | None = None,
                 normalize: bool = False, before: torch.Tensor | None = None) -> torch.Tensor:
        """[n, H] -> the sentence embedding [D] (float32), cut to `dimensions` first and
        normalized after (a cut of a normalized vector, normalized again, is the same).
        `before`: the running pool of the sequence's earlier chunks (mean, max)."""
        if before is None:
            vec = pool(hidden, method, skip)
        else:
            vec = pooled_value(running_pool(hidden, skip, before), method)
        for weight, bias, act in self.dense:
            vec = act(F.linear(vec, weight, bias))
        if dimensions is not None:
            vec = vec[:dimensions]
        return F.normalize(vec, p=2, dim=-1) if normalize else vec
