"""Turn last-token logits into next tokens: penalties, temperature, top-k/p, min-p, seeds.

Lives in executor/ (not model/) because it reads the engine's per-row sampling specs.

Rows are processed as one [R, V] tensor; only per-row generators force a small loop.
Logprobs are reported from the raw model distribution (before penalties and
temperature), as vLLM and OpenAI do.
"""

from __future__ import annotations

from typing import Sequence

import torch

from prelude.engine.batch import SampledToken, SampleSpec
from prelude.engine.request import TokenLogprob


def _apply_penalties(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> None:
    for i, spec in enumerate(specs):
        p = spec.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(spec.prompt_token_ids) | set(spec.output_token_ids)), dtype=torch.long)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and spec.output_token_ids:
            ids, counts = torch.tensor(spec.output_token_ids, dtype=torch.long).unique(return_counts=True)
            logits[i, ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty


def _filter(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p as masks on a [R, V] tensor."""
    temps = torch.tensor([max(s.params.temperature, 1e-5) for s in specs], dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_ks = [s.params.top_k for s in specs]
    top_ps = [s.params.top_p for s in specs]
    min_ps = [s.params.min_p for s in specs]
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
        remove |= torch.arange(vocab).unsqueeze(0) >= ks.unsqueeze(1)
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
        # Drop a token once the mass before it already reaches top_p (the best token always stays).
        before = probs.cumsum(-1) - probs
        remove |= before >= torch.tensor(top_ps, dtype=probs.dtype).unsqueeze(1)
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
    if any(m > 0 for m in min_ps):
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * torch.tensor(min_ps, dtype=probs.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _draw(probs: torch.Tensor, specs: Sequence[SampleSpec]) -> list[int]:
    out: list[int] = []
    for i, spec in enumerate(specs):
        out.append(int(torch.multinomial(probs[i], 1, generator=spec.generator).item()))
    return out


def sample(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[SampledToken]:
    """logits: float32 [R, V], one row per spec."""
    raw_logprobs = None
    if any(s.params.logprobs is not None for s in specs):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    work = logits.clone()
    _apply_penalties(work, specs)
    chosen: list[int | None] = [None] * len(specs)
    random_rows = [i for i, s in enumerate(specs) if not s.params.greedy]
    greedy_rows = [i for i, s in enumerate(specs) if s.params.greedy]
    if greedy_rows:
        ids = work[greedy_rows].argmax(-1).tolist()
        for row, tok in zip(greedy_rows, ids):
            chosen[row] = tok
    if random_rows:
        sub = [specs[i] for i in random_rows]
        probs = _filter(work[random_rows], sub).softmax(-1)
        for row, tok in zip(random_rows, _draw(probs, sub)):
            chosen[row] = tok
    results: list[SampledToken] = []
    for i, spec in enumerate(specs):
        tok = chosen[i]
        assert tok is not None
        lp = None
        if raw_logprobs is not None and spec.params.logprobs is not None:
            row = raw_logprobs[i]
            top: tuple[tuple[int, float], ...] = ()
            if spec.params.logprobs > 0:
                vals, idx = row.topk(spec.params.logprobs)
                top = tuple(zip(idx.tolist(), vals.tolist()))
            lp = TokenLogprob(token_id=tok, logprob=float(row[tok]), top=top)
        results.append(SampledToken(token_id=tok, logprob=lp))
    return results
