"""POST /v1/completions, and the SSE plumbing the chat endpoint shares."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable

import anyio
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest
from starlette.types import Receive, Scope, Send

from prelude.engine.client import EngineClient
from prelude.engine.request import RequestOutput
from prelude.entrypoints.openai.errors import APIError, error_body_for, logger
from prelude.entrypoints.openai.limits import ServerLimits, limits_of, off_loop_if_large
from prelude.entrypoints.openai.fanout import Choice, Job, collect_choices, fan_out, merged_outputs
from prelude.entrypoints.openai.protocol import CompletionRequest, _SamplingFields
from prelude.entrypoints.openai.sampling import (
    completion_logprobs,
    prompt_logprobs_payload,
    sampling_params,
    usage,
)

# --- SSE plumbing (shared with chat) -------------------------------------------------


class SSEResponse(StreamingResponse):
    """An event stream whose event iterator is closed as soon as the response ends.

    Starlette cancels the sending task when the client disconnects; if that happens
    while our generator is parked at a `yield`, nothing would close it until garbage
    collection. Closing it here runs its `finally` blocks now, which cancel the engine
    streams and so abort their requests.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the stream has ended, however it ended."""
        self._on_close.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # runs even when the request task is cancelled
                await self._events.aclose()
            for callback in self._on_close:
                callback()


def sse_stream(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[str, None]:
    """`data: {json}` events, then `data: [DONE]`.

    Headers are already sent, so an error (engine failure, late admission error)
    becomes one `data: {"error": ...}` event, which OpenAI clients raise as an error.
    """

    async def events() -> AsyncGenerator[str, None]:
        async with aclosing(chunks):  # closing us closes the chunk source, and so the engine streams
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            except Exception as exc:  # noqa: BLE001 - reported in-band
                body, status = error_body_for(exc)
                if status >= 500:
                    logger.exception("stream failed")
                yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return events()


@dataclass(frozen=True)
class StreamUsage:
    """What `stream_options` asks for: a final usage chunk, and/or running usage on every chunk."""

    final: bool = False
    continuous: bool = False

    @staticmethod
    def of(req: _SamplingFields) -> StreamUsage:
        opts = req.stream_options
        if opts is None:
            return StreamUsage()
        if not req.stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")
        return StreamUsage(final=opts.include_usage, continuous=opts.include_usage and opts.continuous_usage_stats)

    def per_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The `usage` member of a content chunk: absent, null (OpenAI), or running counts (vLLM)."""
        if not self.final:
            return {}
        return {"usage": usage(prompt_tokens, completion_tokens) if self.continuous else None}


# --- completions ------------------------------------------------------------------


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


def _admit(engine: EngineClient, req: CompletionRequest, limits: ServerLimits) -> _Completion:
    """Validate everything before any work starts, so bad input is a clean 400."""
    _check_unsupported(req)
    prompt_k = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_k = max(prompt_k or 0, req.logprobs)
    params = sampling_params(req, req.max_tokens, req.logprobs, prompt_k)
    limits.check_inputs(len(_prompt_items(req.prompt)), "prompt")
    prompt_ids, prompt_texts = _prompts(engine, req)
    limits.check_tokens([len(ids) for ids in prompt_ids], req.n)
    jobs = fan_out(prompt_ids, params)
    for job in jobs[:: params.n]:  # one check per prompt
        engine.validate(job.prompt_ids, job.params)
    return _Completion(engine, req, jobs, prompt_texts, sum(len(ids) for ids in prompt_ids),
                       f"cmpl-{uuid.uuid4().hex}", int(time.time()))


async def create_completion(engine: EngineClient, req: CompletionRequest, http: HTTPRequest) -> Any:
    stream_usage = StreamUsage.of(req)
    c = await off_loop_if_large(http, _admit, engine, req, limits_of(http))
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
