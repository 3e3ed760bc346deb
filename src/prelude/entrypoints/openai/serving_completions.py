"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator

from fastapi.responses import JSONResponse
from starlette.requests import Request as HTTPRequest

from prelude.engine import stage_trace
from prelude.engine.client import EngineClient
from prelude.engine.request import RequestOutput
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.fanout import Choice, Job, collect_choices, fan_out, merged_outputs
from prelude.entrypoints.openai.limits import ServerLimits, limits_of
from prelude.entrypoints.openai.offload import off_loop_if_large
from prelude.entrypoints.openai.protocol import CompletionRequest
from prelude.entrypoints.openai.sampling import (
    completion_logprobs,
    prompt_logprobs_payload,
    sampling_params,
    usage,
)
from prelude.entrypoints.openai.streaming import SSEResponse, StreamUsage, sse_stream


def _prompt_items(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """str | [str] | [int] | [[int]] -> one item per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _prompts(engine: EngineClient, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids and echo texts of each prompt. Token-id prompts are decoded only for echo."""
    tok = engine.tokenizer
    ids: list[list[int]] = []
    texts: list[str] = []
    for item in _prompt_items(req.prompt):
        if isinstance(item, str):
            ids.append(tok.encode(item, add_special_tokens=True))
            texts.append(item)
            continue
        if not item:
            raise APIError("a token-id prompt must not be empty", param="prompt")
        ids.append(list(item))
        texts.append(tok.decode(item, skip_special_tokens=False) if req.echo else "")
    return ids, texts


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise APIError("suffix is not supported", param="suffix")


@dataclass
class _Completion:
    """One admitted completion request: what every response builder needs."""

    engine: EngineClient
    req: CompletionRequest
    jobs: list[Job]
    prompt_texts: list[str]
    num_prompt_tokens: int  # once per prompt, not per choice
    id: str
    created: int

    @property
    def echo_logprobs(self) -> bool:
        # echo + logprobs also returns the prompt's logprobs (lm-eval's loglikelihood path).
        return self.req.echo and self.req.logprobs is not None

    def echo_text(self, job: Job) -> str:
        return self.prompt_texts[job.prompt_index] if self.req.echo else ""

    def logprobs(self, job: Job, out: RequestOutput | Choice, offset: int, with_prompt: bool) -> dict[str, Any] | None:
        """Legacy logprobs of the generated tokens, preceded by the prompt's under echo."""
        if self.req.logprobs is None:
            return None
        tok = self.engine.tokenizer
        lp = completion_logprobs(tok, list(out.logprobs), offset)
        if with_prompt and self.echo_logprobs and out.prompt_logprobs is not None:
            head = completion_logprobs(tok, list(out.prompt_logprobs), 0, job.prompt_ids)
            lp = {k: head[k] + lp[k] for k in lp}
        return lp

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.engine.model_name, "choices": choices, **extra}


def _prepare(engine: EngineClient, req: CompletionRequest, limits: ServerLimits) -> _Completion:
    """Validate everything before any work starts, so bad input is a clean 400."""
    _check_unsupported(req)
    prompt_k = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_k = max(prompt_k or 0, req.logprobs)
    params = sampling_params(req, req.max_tokens, req.logprobs, prompt_k)
    limits.check_inputs(len(_prompt_items(req.prompt)), "prompt")
    prompt_ids, prompt_texts = _prompts(engine, req)
    stage_trace.mark("tokenize")
    limits.check_tokens([len(ids) for ids in prompt_ids], req.n)
    jobs = fan_out(prompt_ids, params)
    for job in jobs[:: params.n]:  # one check per prompt
        engine.validate(job.prompt_ids, job.params)
    return _Completion(engine, req, jobs, prompt_texts, sum(len(ids) for ids in prompt_ids),
                       f"cmpl-{uuid.uuid4().hex}", int(time.time()))


async def create_completion(engine: EngineClient, req: CompletionRequest, http: HTTPRequest) -> Any:
    stream_usage = StreamUsage.of(req)
    c = await off_loop_if_large(http, _prepare, engine, req, limits_of(http))
    if req.stream:
        return SSEResponse(sse_stream(_stream_chunks(c, stream_usage)))
    choices = await collect_choices(engine, c.id, c.jobs, http)
    return JSONResponse(_full_body(c, choices))


def _full_body(c: _Completion, choices: list[Choice]) -> dict[str, Any]:
    body_choices = []
    for job, choice in zip(c.jobs, choices, strict=True):
        item: dict[str, Any] = {
            "index": choice.index,
            "text": c.echo_text(job) + choice.text,
            "logprobs": c.logprobs(job, choice, len(c.echo_text(job)), with_prompt=True),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if c.req.prompt_logprobs is not None:
            item["prompt_logprobs"] = prompt_logprobs_payload(c.engine.tokenizer, choice.prompt_logprobs or ())
        body_choices.append(item)
    completion_tokens = sum(len(ch.token_ids) for ch in choices)
    return c.body(body_choices, usage=usage(c.num_prompt_tokens, completion_tokens))


async def _stream_chunks(c: _Completion, stream_usage: StreamUsage) -> AsyncGenerator[dict[str, Any], None]:
    """One chunk per engine increment of any choice, in arrival order."""
    offsets = {job.index: len(c.echo_text(job)) for job in c.jobs}  # text_offset continues per choice
    started: set[int] = set()
    completion_tokens = 0
    async with aclosing(merged_outputs(c.engine, c.id, c.jobs)) as outputs:
        async for job, out in outputs:
            first = job.index not in started
            started.add(job.index)
            if not (first or out.text or out.new_token_ids or out.finished):
                continue
            completion_tokens += len(out.new_token_ids)
            lp = c.logprobs(job, out, offsets[job.index], with_prompt=first)
            offsets[job.index] += sum(len(c.engine.tokenizer.token_text(t.token_id)) for t in out.logprobs)
            choice: dict[str, Any] = {
                "index": job.index,
                "text": (c.echo_text(job) if first else "") + out.text,
                "logprobs": lp,
                "finish_reason": out.finish_reason.value if out.finish_reason else None,
                "stop_reason": out.stop_reason,
            }
            if c.req.prompt_logprobs is not None and first:
                choice["prompt_logprobs"] = prompt_logprobs_payload(c.engine.tokenizer, out.prompt_logprobs or ())
            yield c.body([choice], **stream_usage.per_chunk(c.num_prompt_tokens, completion_tokens))
    if stream_usage.final:
        yield c.body([], usage=usage(c.num_prompt_tokens, completion_tokens))
