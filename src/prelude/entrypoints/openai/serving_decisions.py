"""Typed decisions: OpenAI's POST /v1/decisions and TypeSafe's POST /v1/systemone.

Every question about one input is answered in one forward. The rendered input is the
shared part of a OneShot row (looked up in and published to the prefix cache); a question
whose options are distinct one-token answers is a packed item after it (decision_prompts.py),
which sees the input and itself only, its options' log-probabilities read at its end (the
label head over the whole vocabulary, for the row's options together). A question with longer
options gets a row of its own, the input and the question as the shared part and its
options packed after it, scored whole by teacher forcing; its input blocks come from the
prefix cache, or from the packed row leading the same step (its riders). Rows hold as many
items as the context allows; more questions than that make more rows, whose answers are
the same, each item seeing only the input and itself.

An option's log-probability is that of its whole token sequence under the full
vocabulary; a question's probabilities are the softmax of its options' log-probabilities.
A question is refused (`/v1/decisions`) when its options together hold less than the
refusal threshold of the probability: the model would have answered something else.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest

from prelude.engine.client import EngineClient
from prelude.engine.request import PoolingParams, PoolingTask, RequestOutput, SamplingParams
from prelude.entrypoints.openai.decision_prompts import Rendered, render
from prelude.entrypoints.openai.decision_protocol import (
    Asked,
    DecisionInput,
    DecisionRequest,
    SystemOneRequest,
    decision_input,
    decision_questions,
    systemone_questions,
    systemone_state,
)
from prelude.entrypoints.openai.disconnect import until_disconnect
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.limits import limits_of
from prelude.entrypoints.openai.offload import off_loop_if_large

# A question's options must hold at least this much of the next-token probability mass (all
# of their sequences together) to be answered; below it, the model would have said something
# else (a refusal, a hedge, another answer), and /v1/decisions answers with a refusal.
DEFAULT_REFUSAL_THRESHOLD = 0.0
_NO_GEN = SamplingParams(max_tokens=0)


@dataclass(frozen=True)
class Reading:
    """What one question was read from, and what was read."""

    logprobs: list[float]  # per option: log P(its tokens | the prompt), over the whole vocabulary
    prompt_ids: list[int]
    label_ids: list[list[int]]

    @property
    def probabilities(self) -> list[float]:
        top = max(self.logprobs)
        e = [math.exp(lp - top) for lp in self.logprobs]
        total = math.fsum(e)
        return [v / total for v in e]

    @property
    def mass(self) -> float:
        return math.fsum(math.exp(lp) for lp in self.logprobs)


@dataclass(frozen=True)
class _Row:
    """One engine request: a prompt and, for each score it returns, (question, option) it
    belongs to (option None: a question item whose end reads all its options)."""

    prompt: list[int]
    pooling: PoolingParams
    reads: tuple[tuple[int, int | None], ...]


def _single_tokens(labels: list[list[int]]) -> bool:
    return all(len(t) == 1 for t in labels)


def _whole_label_rows(prompt: list[int], q: int, labels: list[list[int]], max_len: int) -> list[_Row]:
    """A question's options scored whole: packed as items after the input and the question
    (the shared part, its input blocks from the prefix cache or a leader in the same step),
    as many per row as `max_len` allows."""
    rows: list[_Row] = []
    start = 0
    while start < len(labels):
        end, used = start, len(prompt)
        while end < len(labels) and (end == start or used + len(labels[end]) <= max_len):
            used += len(labels[end])
            end += 1
        part = labels[start:end]
        pooling = PoolingParams(PoolingTask.SEQUENCE_LOGPROBS, item_lens=tuple(len(t) for t in part))
        rows.append(_Row(prompt + [t for label in part for t in label], pooling,
                         tuple((q, j) for j in range(start, end))))
        start = end
    return rows


def _packed_rows(r: Rendered, max_len: int) -> list[_Row]:
    """Questions with one-token options: items after the shared input, as many per row as
    `max_len` allows, each read at its end. Any other question: a row of its own with its
    options packed after it, so that its words are computed once, not once per option."""
    rows: list[_Row] = []
    group: list[int] = []

    def flush() -> None:
        if group:
            # Every item's end reads the union of the row's options (full-vocabulary
            # logprobs); each question keeps its own.
            ids = tuple(sorted({label[0] for q in group for label in r.labels[q]}))
            pooling = PoolingParams(PoolingTask.LABELS, label_token_ids=ids,
                                    item_lens=tuple(len(r.items[q]) for q in group))
            rows.append(_Row(r.prefix + [t for q in group for t in r.items[q]], pooling,
                             tuple((q, None) for q in group)))
            group.clear()

    used = len(r.prefix)
    for q, (item, labels) in enumerate(zip(r.items, r.labels)):
        if not _single_tokens(labels):
            rows.extend(_whole_label_rows(r.prefix + item, q, labels, max_len))
            continue
        if group and used + len(item) > max_len:
            flush()
            used = len(r.prefix)
        group.append(q)
        used += len(item)
    flush()
    return rows


def _single_rows(r: Rendered, max_len: int) -> list[_Row]:
    """One row per question, read by the one-prompt heads: one-token options as label
    scores at the prompt's end, longer ones scored whole."""
    rows = []
    for q, (item, labels) in enumerate(zip(r.items, r.labels)):
        if _single_tokens(labels):
            pooling = PoolingParams(PoolingTask.LABELS, label_token_ids=tuple(t[0] for t in labels))  # full vocabulary
            rows.append(_Row(r.prefix + item, pooling, ((q, None),)))
        else:
            rows.extend(_whole_label_rows(r.prefix + item, q, labels, max_len))
    return rows


def _check_context(r: Rendered, max_len: int) -> None:
    longest = max(len(item) + max(map(len, labels)) for item, labels in zip(r.items, r.labels))
    if len(r.prefix) + longest > max_len:
        raise APIError(f"input: the input renders to {len(r.prefix)} tokens and its longest question with its "
                       f"answer to {longest} more; this model's context is {max_len} tokens", param="input",
                       code="context_length_exceeded")


def _scores(row: _Row, out: RequestOutput, logprobs: list[list[float]], labels: list[list[list[int]]]) -> None:
    """Spread a row's scores over its questions' options: label scores come per read
    position (an item's end, or the prompt's) over all the row's label ids; whole-label
    scores one per option."""
    scores = list(out.scores or ())
    ids = row.pooling.label_token_ids
    where = {token: i for i, token in enumerate(ids)}
    for at, (q, option) in enumerate(row.reads):
        if option is None:  # the question's one-token options, read at its end
            base = at * len(ids)
            logprobs[q][:] = [scores[base + where[label[0]]] for label in labels[q]]
        else:
            logprobs[q][option] = scores[at]


async def _encode_rows(engine: EngineClient, rows: list[_Row], shared: int, http: HTTPRequest) -> list[RequestOutput]:
    """The rows' engine requests, all refused before any runs if one is bad. The request's
    size counts the input once (`shared` tokens begin every row): the rows after the first
    read it from the prefix cache, they do not hold it again."""
    limits_of(http).check_tokens([shared] + [len(row.prompt) - shared for row in rows], param="questions")
    for row in rows:
        engine.validate(row.prompt, _NO_GEN, row.pooling)
    prefix = f"decision-{uuid.uuid4().hex}"
    calls = [engine.encode(f"{prefix}-{i}", row.prompt, row.pooling) for i, row in enumerate(rows)]
    return await until_disconnect(asyncio.gather(*calls), http)


async def read_questions(engine: EngineClient, source: DecisionInput, questions: list[Asked], params: list[str],
                         multi_item: bool, http: HTTPRequest) -> tuple[list[Reading], int, int]:
    """Each question's reading; the prompt tokens of the request's rows and how many of
    them the prefix cache served."""
    if not engine.can_generate:
        raise APIError("model: typed decisions need a model with a language-model head", param="model")
    limits_of(http).check_inputs(len(questions), "questions")
    rendered = await off_loop_if_large(http, render, engine, source, questions, params)
    if any(not item for item in rendered.items):
        raise APIError("input: the chat template leaves a question nothing of its own", param="input")
    _check_context(rendered, engine.max_model_len)
    rows = _packed_rows(rendered, engine.max_model_len) if multi_item else _single_rows(rendered, engine.max_model_len)
    outs = await _encode_rows(engine, rows, len(rendered.prefix), http)
    logprobs = [[0.0] * len(labels) for labels in rendered.labels]
    for row, out in zip(rows, outs):
        _scores(row, out, logprobs, rendered.labels)
    readings = [Reading(lps, rendered.prefix + item, labels)
                for lps, item, labels in zip(logprobs, rendered.items, rendered.labels)]
    return readings, sum(len(row.prompt) for row in rows), sum(out.num_cached_tokens for out in outs)


def _options_param(q: Asked, where: str) -> str:
    return f"{where}.{'choices' if q.kind == 'choice' else 'levels' if q.kind == 'score' else 'type'}"


def _count(http: HTTPRequest, route: str, answers: list[tuple[str, bool]]) -> None:
    """Prometheus: one decision, and its questions by type and outcome."""
    metrics = getattr(getattr(getattr(http, "app", None), "state", None), "metrics", None)
    if metrics is not None:
        metrics.count_decision(route, answers)


def _debug(reading: Reading) -> dict[str, Any]:
    """What an answer was read from (return_prompt_token_ids): the prompt ids, each
    option's ids and its log-probability over the whole vocabulary."""
    return {"prompt_token_ids": reading.prompt_ids, "label_token_ids": reading.label_ids,
            "label_logprobs": reading.logprobs}


def decision_answer(q: Asked, reading: Reading, threshold: float, debug: bool) -> dict[str, Any]:
    """One answer of OpenAI's shape."""
    answer: dict[str, Any]
    if reading.mass < threshold:
        answer = {"type": "refusal", "name": q.name}
    else:
        probs = reading.probabilities
        best = max(range(len(probs)), key=probs.__getitem__)
        if q.kind == "predicate":
            answer = {"type": "predicate", "name": q.name, "probability": probs[0]}
        elif q.kind == "choice":
            answer = {"type": "choice", "name": q.name, "choice": q.options[best].value, "confidence": probs[best],
                      "probabilities": [{"value": o.value, "probability": p} for o, p in zip(q.options, probs)]}
        else:
            answer = {"type": "score", "name": q.name, "score": math.fsum(i * p for i, p in enumerate(probs)),
                      "confidence": probs[best],
                      "probabilities": [{"value": i, "label": o.label, "probability": p}
                                        for i, (o, p) in enumerate(zip(q.options, probs))]}
    if debug:
        answer.update(_debug(reading))
    return answer


async def create_decision(engine: EngineClient, req: DecisionRequest, http: HTTPRequest) -> dict[str, Any]:
    """OpenAI's POST /v1/decisions: answers in question order."""
    source = decision_input(req.input)
    questions = decision_questions(req.questions)
    params = [_options_param(q, f"questions.{i}") for i, q in enumerate(questions)]
    readings, n_input, n_cached = await read_questions(engine, source, questions, params, req.multi_item, http)
    threshold = DEFAULT_REFUSAL_THRESHOLD if req.refusal_threshold is None else req.refusal_threshold
    answers = [decision_answer(q, r, threshold, req.return_prompt_token_ids) for q, r in zip(questions, readings)]
    _count(http, "/v1/decisions", [(q.kind, a["type"] == "refusal") for q, a in zip(questions, answers)])
    return {"answers": answers, "model": engine.model_name,
            "usage": {"input_tokens": n_input,
                      "input_tokens_details": {"cached_tokens": n_cached, "cache_write_tokens": 0},
                      "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n_input}}


def systemone_answer(q: Asked, reading: Reading, debug: bool) -> dict[str, Any]:
    """One answer of TypeSafe's shape (it has no refusal: every question is answered)."""
    probs = reading.probabilities
    best = max(range(len(probs)), key=probs.__getitem__)
    answer: dict[str, Any]
    if q.kind == "predicate":
        answer = {"type": "noul", "noul": probs[0]}
    elif q.kind == "choice":
        answer = {"type": "choice", "choice": q.options[best].label, "confidence": probs[best],
                  "probabilities": {o.label: p for o, p in zip(q.options, probs)}}
    else:
        answer = {"type": "score", "score": math.fsum(i * p for i, p in enumerate(probs)), "confidence": probs[best],
                  "legend": {o.label: o.description for o in q.options},
                  "probabilities": {o.label: p for o, p in zip(q.options, probs)}}
    if debug:
        answer.update(_debug(reading))
    return answer


async def create_systemone(engine: EngineClient, req: SystemOneRequest, http: HTTPRequest) -> dict[str, Any]:
    """TypeSafe's POST /v1/systemone: answers keyed by the questions' ids."""
    source = systemone_state(req.state)
    keyed = systemone_questions(req.questions)
    questions = [q for _, q in keyed]
    params = [f"questions.{key}.{'type' if q.kind == 'predicate' else 'criteria'}" for key, q in keyed]
    readings, n_input, _ = await read_questions(engine, source, questions, params, req.multi_item, http)
    answers = {key: systemone_answer(q, r, req.return_prompt_token_ids) for (key, q), r in zip(keyed, readings)}
    _count(http, "/v1/systemone", [(q.kind, False) for q in questions])
    return {"model": engine.model_name, "answers": answers, "usage": {"input_tokens": n_input, "output_tokens": 0}}
