"""Fixed-output APIs, all OneShot: /v1/embeddings, /classify, /score, /rerank, /reward.

Every input of a request becomes one engine request; the scheduler batches them into
OneShot steps grouped by head.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Sequence

from starlette.requests import Request as HTTPRequest

from prelude.engine import stage_trace
from prelude.engine.client import EngineClient
from prelude.engine.request import PoolingParams, PoolingTask, RequestOutput, SamplingParams
from prelude.entrypoints.openai.disconnect import until_disconnect
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.limits import limits_of
from prelude.entrypoints.openai import score_templates
from prelude.entrypoints.openai.offload import off_loop_if_large
from prelude.params import EmbedSetup
from prelude.entrypoints.openai.protocol import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    RewardRequest,
    ScoreRequest,
)

_NO_GEN = SamplingParams(max_tokens=0)

# A causal LM scores relevance as P("yes") after this question (see --score-template).
DEFAULT_SCORE_TEMPLATE = (
    "Judge whether the document answers the query. Reply with only yes or no.\n"
    "Query: {query}\nDocument: {document}"
)


def _softmax(xs: Sequence[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    total = sum(e)
    return [v / total for v in e]


def _sigmoid(x: float) -> float:
    if x < 0:  # exp of a large positive number overflows
        e = math.exp(x)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(-x))


def _activated(scores: Sequence[float], activation: str) -> list[float]:
    """A head's outputs through `activation`: softmax over them, a sigmoid of each, or as they are."""
    if activation == "softmax":
        return _softmax(scores)
    if activation == "sigmoid":
        return [_sigmoid(s) for s in scores]
    return list(scores)


def _input_list(value: Any, param: str) -> list[str | list[int]]:
    """str | [str] | [int] | [[int]] -> one item per input; empty batches are rejected."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(f"{param} must not be empty", param=param)
    if isinstance(value[0], int):
        return [list(value)]
    return list(value)


async def encode_all(
    engine: EngineClient, prefix: str, prompts: list[list[int]], pooling: list[PoolingParams], http: HTTPRequest
) -> list[RequestOutput]:
    limits = limits_of(http)
    limits.check_inputs(len(prompts), "input")
    limits.check_tokens([len(ids) for ids in prompts], param="input")
    for ids, p in zip(prompts, pooling):  # refuse the whole batch before any work starts
        if not ids:
            raise APIError("an input is empty")
        engine.validate(ids, _NO_GEN, p)
    calls = [engine.encode(f"{prefix}-{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, pooling))]
    return await until_disconnect(asyncio.gather(*calls), http)


def _tokens(engine: EngineClient, item: str | list[int], chat: bool = False) -> list[int]:
    if isinstance(item, list):
        return item
    if chat:
        try:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": item}], add_generation_prompt=True)
        except ValueError as exc:  # the model has no chat template: the request asked for one
            raise APIError(str(exc), param="use_chat_template") from exc
        return engine.tokenizer.encode(text, add_special_tokens=False)
    return engine.tokenizer.encode(item, add_special_tokens=True)


async def _tokenized(http: HTTPRequest, engine: EngineClient, items: list[str | list[int]],
                     chat: bool = False) -> list[list[int]]:
    """Token ids of each input; the count is checked first, big bodies are tokenized off the loop."""
    limits_of(http).check_inputs(len(items), "input")
    ids = await off_loop_if_large(http, lambda: [_tokens(engine, item, chat) for item in items])
    stage_trace.mark("tokenize")
    return ids


def _usage(prompts: list[list[int]]) -> dict[str, int]:
    n = sum(len(p) for p in prompts)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


def _label_tokens(engine: EngineClient, labels: list[str]) -> list[list[int]]:
    if not labels:
        raise APIError("labels must not be empty", param="labels")
    out = []
    for label in labels:
        toks = engine.tokenizer.encode(label, add_special_tokens=False)
        if not toks:
            raise APIError(f"label {label!r} has no tokens", param="labels")
        out.append(toks)
    return out


@dataclass(frozen=True)
class LabelScoring:
    """How /classify scores candidate labels after each prompt."""

    pooling: PoolingParams
    suffix: list[int]  # tokens appended to every prompt (the labels as items), or none
    lengths: list[int]  # tokens per label


def label_scoring(engine: EngineClient, labels: list[str]) -> LabelScoring:
    """Distinct one-token labels: a softmax over the gathered label rows of the LM head.
    Otherwise every label's whole token sequence is scored (the sum of its token
    logprobs; labels may share first tokens), the labels as items after the
    prompt: K labels cost one forward."""
    toks = _label_tokens(engine, labels)
    firsts = tuple(t[0] for t in toks)
    lengths = [len(t) for t in toks]
    if max(lengths) == 1 and len(set(firsts)) == len(firsts):
        return LabelScoring(PoolingParams(PoolingTask.LABELS, label_token_ids=firsts, label_softmax=True), [], lengths)
    pooling = PoolingParams(PoolingTask.SEQUENCE_LOGPROBS, item_lens=tuple(lengths))
    return LabelScoring(pooling, [t for label in toks for t in label], lengths)


def _label_token_ids(engine: EngineClient, labels: list[str]) -> tuple[int, ...]:
    """First token of each label (the yes/no relevance labels); they must differ."""
    ids = tuple(t[0] for t in _label_tokens(engine, labels))
    if len(set(ids)) != len(ids):
        raise APIError("labels must start with different tokens", param="labels")
    return ids


def _prompt_text(setup: EmbedSetup | None, name: str | None) -> str | None:
    """The prompt a request's texts start with: `prompt_name`'s, else the model's default."""
    if setup is None:
        if name is not None:
            raise APIError("prompt_name: this model has no prompts", param="prompt_name")
        return None
    try:
        return setup.prompt(name)
    except KeyError:
        names = ", ".join(n for n, _ in setup.prompts) or "none"
        raise APIError(f"prompt_name {name!r} is not one of this model's prompts ({names})",
                       param="prompt_name") from None


def _prompt_tokens(engine: EngineClient, prompt: str, ids: list[int]) -> int:
    """How many leading tokens of `ids` (prompt + text) are the prompt's: the tokens it
    shares with the prompt encoded alone (a trailing special token such as EOS, which the
    text's encoding has at its end only, is not shared)."""
    alone = engine.tokenizer.encode(prompt, add_special_tokens=True)
    n = 0
    while n < min(len(alone), len(ids)) and alone[n] == ids[n]:
        n += 1
    return n


async def create_embeddings(engine: EngineClient, req: EmbeddingRequest, http: HTTPRequest) -> dict[str, Any]:
    setup: EmbedSetup | None = getattr(engine, "embed_setup", None)
    if req.dimensions is not None:
        why = setup.check_dimensions(req.dimensions) if setup is not None else "this model has a fixed embedding size"
        if why is not None:
            raise APIError(why, param="dimensions")
    items = _input_list(req.input, "input")
    prompt = _prompt_text(setup, req.prompt_name)
    if prompt:  # text inputs only: token ids are taken as they are
        items = [prompt + item if isinstance(item, str) else item for item in items]
    prompts = await _tokenized(http, engine, items)
    normalize = req.normalize if req.normalize is not None else (setup.normalize if setup is not None else True)
    base = PoolingParams(PoolingTask.EMBED, pooling=req.pooling, normalize=normalize, dimensions=req.dimensions)
    poolings = [base] * len(prompts)
    if prompt and setup is not None and not setup.include_prompt:  # the prompt's tokens are left out of the pool
        poolings = [replace(base, skip_tokens=_prompt_tokens(engine, prompt, ids)) if isinstance(item, str) else base
                    for item, ids in zip(items, prompts)]
    outs = await encode_all(engine, f"embd-{uuid.uuid4().hex}", prompts, poolings, http)
    data = []
    for i, out in enumerate(outs):
        vec = list(out.embedding or ())
        value: Any = vec
        if req.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    usage = _usage(prompts)
    usage.pop("completion_tokens")
    return {"object": "list", "data": data, "model": engine.model_name, "usage": usage}


async def create_classification(engine: EngineClient, req: ClassifyRequest, http: HTTPRequest) -> dict[str, Any]:
    prompts = await _tokenized(http, engine, _input_list(req.input, "input"), req.use_chat_template)
    lengths: list[int] | None = None
    if req.labels is not None:
        # Whole-label classification: softmax over the labels' sequence logprobs.
        names = list(req.labels)
        scoring = label_scoring(engine, names)
        pooling, lengths = scoring.pooling, scoring.lengths
        prompts = [p + scoring.suffix for p in prompts]
    else:
        if not engine.labels:
            raise APIError("this model has no classification head: pass candidate labels", param="labels")
        names = list(engine.labels)
        pooling = PoolingParams(PoolingTask.CLASSIFY)
    outs = await encode_all(engine, f"classify-{uuid.uuid4().hex}", prompts, [pooling] * len(prompts), http)
    activation = req.activation or ("softmax" if lengths is not None or len(names) > 1 else "sigmoid")
    if activation == "softmax" and len(names) == 1:
        raise APIError("activation softmax over one output is always 1: use sigmoid or none", param="activation")
    if activation == "sigmoid" and lengths is not None:
        raise APIError("activation sigmoid does not apply to candidate labels (their scores are logprobs): use "
                       "softmax or none", param="activation")
    data = []
    for i, out in enumerate(outs):
        scores = list(out.scores or ())
        if lengths is not None and req.normalize == "mean":
            scores = [v / n for v, n in zip(scores, lengths)]
        probs = _activated(scores, activation)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": names[best], "probs": probs, "num_classes": len(probs)})
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": engine.model_name, "data": data, "usage": _usage(prompts)}


async def create_reward(engine: EngineClient, req: RewardRequest, http: HTTPRequest) -> dict[str, Any]:
    if len(engine.labels) != 1:
        raise APIError("reward needs a model whose head has exactly one output")
    prompts = await _tokenized(http, engine, _input_list(req.input, "input"))
    pooling = PoolingParams(PoolingTask.CLASSIFY)
    outs = await encode_all(engine, f"reward-{uuid.uuid4().hex}", prompts, [pooling] * len(prompts), http)
    data = [{"index": i, "object": "reward", "score": _activated(out.scores or (0.0,), req.activation)[0]}
            for i, out in enumerate(outs)]
    return {"id": f"reward-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": engine.model_name, "data": data, "usage": _usage(prompts)}


def _check_template(template: str) -> None:
    if "{query}" not in template or "{document}" not in template:
        raise APIError("template must contain {query} and {document}", param="template")


async def relevance_scores(
    engine: EngineClient, pairs: list[tuple[str, str]], template: str | None, http: HTTPRequest,
    instruction: str | None = None,
) -> tuple[list[float], list[list[int]]]:
    """Cross-encoder head scores (a token reranker's under its own template: its head is
    made from its yes/no rows at load), or for a causal LM P("yes") under a template."""
    if engine.labels:
        encode_pair = getattr(engine.tokenizer, "encode_pair", None)
        own = score_templates.TEMPLATES.get(getattr(engine, "score_template", None) or "")
        if template is not None:
            _check_template(template)
        prompts, poolings = [], []
        for q, d in pairs:
            types = None
            if template is not None:
                ids = engine.tokenizer.encode(template.replace("{query}", q).replace("{document}", d))
            elif own is not None:
                ids = own(engine.tokenizer, q, d, instruction)
            elif engine.is_encoder and encode_pair is not None:
                ids, types = encode_pair(q, d)
            else:
                ids = engine.tokenizer.encode(q + "\n" + d)
            prompts.append(ids)
            poolings.append(PoolingParams(PoolingTask.CLASSIFY, token_type_ids=tuple(types) if types else None))
        outs = await encode_all(engine, f"score-{uuid.uuid4().hex}", prompts, poolings, http)
        scores = []
        for out in outs:
            s = list(out.scores or ())
            scores.append(_sigmoid(s[0]) if len(s) == 1 else _softmax(s)[-1])
        return scores, prompts
    if not engine.can_generate:
        raise APIError("this model has neither a score head nor a language-model head")
    tmpl = template or DEFAULT_SCORE_TEMPLATE
    _check_template(tmpl)
    labels = _label_token_ids(engine, ["yes", "no"])
    prompts = []
    for q, d in pairs:
        question = tmpl.replace("{query}", q).replace("{document}", d)
        prompts.append(_tokens(engine, question, chat=engine.tokenizer.chat_template is not None))
    pooling = PoolingParams(PoolingTask.LABELS, label_token_ids=labels, label_softmax=True)
    outs = await encode_all(engine, f"score-{uuid.uuid4().hex}", prompts, [pooling] * len(prompts), http)
    return [_softmax(list(out.scores or (0.0, 0.0)))[0] for out in outs], prompts


async def create_score(engine: EngineClient, req: ScoreRequest, http: HTTPRequest) -> dict[str, Any]:
    """vLLM's cross-encoder pairs (text_1, text_2); SGLang's query/items shape is
    serving_generative_score's."""
    if req.text_1 is None or req.text_2 is None:
        raise APIError("pass text_1 and text_2, or query, items and label_token_ids", param="text_1")
    first = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    second = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    if not first or not second:
        raise APIError("text_1 and text_2 must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise APIError("text_1 must be one text or as many texts as text_2", param="text_1")
    limits_of(http).check_inputs(len(second), "text_2")
    scores, prompts = await relevance_scores(engine, list(zip(first, second)), req.template, http, req.instruction)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": engine.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(prompts)}


def _document_text(doc: str | dict[str, Any], i: int) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc.get("text"), str):
        return doc["text"]
    raise APIError(f"documents[{i}] must be a string or have a text field", param="documents")


async def create_rerank(engine: EngineClient, req: RerankRequest, http: HTTPRequest) -> dict[str, Any]:
    if not req.documents:
        raise APIError("documents must not be empty", param="documents")
    limits_of(http).check_inputs(len(req.documents), "documents")
    docs = [_document_text(d, i) for i, d in enumerate(req.documents)]
    scores, prompts = await relevance_scores(engine, [(req.query, d) for d in docs], req.template, http,
                                             req.instruction)
    order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
    if req.top_n:  # None or 0: every document (as vLLM and Cohere's API)
        order = order[: req.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    total = sum(len(p) for p in prompts)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": engine.model_name, "results": results,
            "usage": {"total_tokens": total, "prompt_tokens": total}}
