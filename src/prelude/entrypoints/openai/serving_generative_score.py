"""Generative scoring: SGLang's `/v1/score` shape (query, items, label_token_ids) and
vLLM's `/generative_scoring`.

Each item is scored by the next-token probabilities of the label ids after query+item
(or item+query with `item_first`). Items after one query share a OneShot row (a multi-item prompt)
(each sees the query and itself only, see PoolingParams.item_lens), as many per row as
the context allows; the query is a prefix-cache entry like any other. With
`apply_softmax` the probabilities are renormalized over the labels, which needs only the
label rows of the LM head; without it they are the full-vocabulary probabilities.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from starlette.requests import Request as HTTPRequest

from prelude.engine.client import EngineClient
from prelude.engine.request import PoolingParams, PoolingTask
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.limits import limits_of
from prelude.entrypoints.openai.protocol import GenerativeScoringRequest, ScoreRequest
from prelude.entrypoints.openai.serving_pooling import encode_all
from prelude.tokenizer.prefix_encode import encode_joined


@dataclass(frozen=True)
class ScoringJob:
    """One engine request: a prompt and the items at its end (none: one item alone)."""

    prompt: list[int]
    item_lens: tuple[int, ...]
    item_indices: tuple[int, ...]  # which input items it scores, in order


def group_items(query: list[int], items: list[list[int]], max_len: int, multi_item: bool) -> list[ScoringJob]:
    """Group items after the query into rows of at most `max_len` tokens (a row with one
    item is a plain prompt). Without `multi_item`, every item gets its own row."""
    jobs: list[ScoringJob] = []
    group: list[int] = []

    def flush() -> None:
        if not group:
            return
        if len(group) == 1:
            jobs.append(ScoringJob(query + items[group[0]], (), (group[0],)))
        else:
            prompt = query + [t for i in group for t in items[i]]
            jobs.append(ScoringJob(prompt, tuple(len(items[i]) for i in group), tuple(group)))
        group.clear()

    used = len(query)
    for i, item in enumerate(items):
        if group and (not multi_item or used + len(item) > max_len):
            flush()
            used = len(query)
        group.append(i)
        used += len(item)
    flush()
    return jobs


def _ids(engine: EngineClient, value: str | list[int], add_special_tokens: bool) -> list[int]:
    if isinstance(value, list):
        return list(value)
    return engine.tokenizer.encode(value, add_special_tokens=add_special_tokens)


def _query_ids(engine: EngineClient, value: str | list[int], add_special_tokens: bool) -> list[int]:
    """A scoring query, memoized by the tokenizer: clients send one query with batch after
    batch of items. Its ids are joined to each item's ids, so there is no text joint."""
    if isinstance(value, list):
        return list(value)
    return encode_joined(engine.tokenizer, value, "", add_special_tokens)


async def label_probabilities(
    engine: EngineClient,
    query: str | list[int],
    items: Sequence[str | list[int]],
    label_token_ids: list[int],
    apply_softmax: bool,
    item_first: bool,
    multi_item: bool,
    http: HTTPRequest,
    add_special_tokens: bool = True,
) -> tuple[list[list[float]], int]:
    """Per item, the probability of each label id; and the prompt tokens computed."""
    if not engine.can_generate:
        raise APIError("generative scoring needs a model with a language-model head")
    if not label_token_ids:
        raise APIError("label_token_ids must hold at least one token id", param="label_token_ids")
    if not items:
        raise APIError("items must not be empty", param="items")
    # the items, not the multi-item rows (far fewer): --max-batch-inputs bounds what a request holds
    limits_of(http).check_inputs(len(items), "items")
    q = _query_ids(engine, query, add_special_tokens)
    item_ids = [_ids(engine, item, add_special_tokens=False) for item in items]
    if any(not ids for ids in item_ids):
        raise APIError("an item is empty", param="items")
    if item_first:  # no shared prefix: each item+query is its own prompt
        jobs = [ScoringJob(ids + q, (), (i,)) for i, ids in enumerate(item_ids)]
    else:
        if not q:
            raise APIError("the query is empty", param="query")
        jobs = group_items(q, item_ids, engine.max_model_len, multi_item)
    labels = tuple(label_token_ids)
    poolings = [PoolingParams(PoolingTask.LABELS, label_token_ids=labels, label_softmax=apply_softmax,
                              item_lens=job.item_lens) for job in jobs]
    outs = await encode_all(engine, f"score-{uuid.uuid4().hex}", [j.prompt for j in jobs], poolings, http)
    k = len(labels)
    probs: list[list[float]] = [[] for _ in items]
    for job, out in zip(jobs, outs):
        scores = list(out.scores or ())
        for slot, i in enumerate(job.item_indices):
            probs[i] = [math.exp(lp) for lp in scores[slot * k : (slot + 1) * k]]
    return probs, sum(len(j.prompt) for j in jobs)


def _items(value: str | list[str] | list[list[int]] | None) -> list[str | list[int]]:
    if value is None:
        raise APIError("items is required with query", param="items")
    if isinstance(value, str):
        return [value]
    return list(value)


async def create_generative_score(engine: EngineClient, req: ScoreRequest, http: HTTPRequest) -> dict[str, Any]:
    """SGLang's /v1/score response: one list of label probabilities per item."""
    if req.query is None:
        raise APIError("query is required with items and label_token_ids", param="query")
    if req.label_token_ids is None:
        raise APIError("label_token_ids is required for generative scoring", param="label_token_ids")
    probs, n_tokens = await label_probabilities(
        engine, req.query, _items(req.items), req.label_token_ids, req.apply_softmax, req.item_first,
        req.multi_item, http,
    )
    return {"scores": probs, "model": engine.model_name, "object": "scoring",
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0}}


async def create_generative_scoring(
    engine: EngineClient, req: GenerativeScoringRequest, http: HTTPRequest
) -> dict[str, Any]:
    """vLLM's /generative_scoring response: the first label's probability per item."""
    probs, n_tokens = await label_probabilities(
        engine, req.query, list(req.items), req.label_token_ids, req.apply_softmax, req.item_first,
        req.multi_item, http, add_special_tokens=req.add_special_tokens,
    )
    return {"id": f"generative-scoring-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": engine.model_name,
            "data": [{"index": i, "object": "score", "score": p[0]} for i, p in enumerate(probs)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0}}
