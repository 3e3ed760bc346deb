"""POST /v1/chat/completions: the model's chat template, then the same engine path."""

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
from prelude.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from prelude.entrypoints.openai.sampling import chat_logprobs, sampling_params, usage
from prelude.entrypoints.openai.streaming import SSEResponse, StreamUsage, sse_stream
from prelude.tokenizer.prefix_encode import encode_chat_prompt

# --- prompt rendering (also used by /tokenize) -----------------------------------------


# OpenAI's (and vLLM's) image, audio and video content parts
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "video")


def _content_text(msg: ChatMessage, i: int) -> str:
    """String content, or text parts joined by newlines; any other part is refused."""
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for part in msg.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type")
            if kind in MEDIA_PARTS:  # a vision checkpoint's tower is left out at load: its text model is served
                raise APIError(f"messages[{i}]: {kind} content is not supported: this server serves a text model "
                               "(only text content parts are supported)", param=f"messages.{i}.content")
            raise APIError(f"messages[{i}]: only text content parts are supported, got {kind!r}",
                           param=f"messages.{i}.content")
        parts.append(part["text"])
    return "\n".join(parts)


def _template_message(msg: ChatMessage, i: int) -> dict[str, Any]:
    """The dict a chat template sees: role and text, plus name / tool_call_id when given."""
    out: dict[str, Any] = {"role": msg.role, "content": _content_text(msg, i)}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    return out


def _render_text(engine: EngineClient, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 template_kwargs: dict[str, Any]) -> str:
    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    **template_kwargs)
    except ValueError as exc:  # no template
        raise APIError(str(exc)) from exc
    except Exception as exc:  # a template's raise_exception() or a render error: the input's fault
        raise APIError(f"chat template error: {exc}") from exc


def _cut_after_final(text: str, messages: list[dict[str, Any]]) -> str:
    """continue_final_message: end the prompt right after the last assistant message's
    text, dropping the end-of-turn the template appended, so the model continues it."""
    final = messages[-1]
    cut = text.rfind(final["content"]) if final["content"] else -1
    if final["role"] != "assistant" or cut < 0:
        raise APIError("continue_final_message needs a final, non-empty assistant message", param="messages")
    return text[: cut + len(final["content"])]


def render_chat(engine: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Chat prompt token ids (the template already holds any BOS, so none is added)."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    plain = [_template_message(m, i) for i, m in enumerate(messages)]
    # Continuing the final message excludes opening a new assistant turn.
    text = _render_text(engine, plain, add_generation_prompt and not continue_final, template_kwargs or {})
    if continue_final:
        text = _cut_after_final(text, plain)
    ids = encode_chat_prompt(engine.tokenizer, text, plain)  # the system turn through the prefix memo
    stage_trace.mark("tokenize")
    return ids


# --- completions ---------------------------------------------------------------------


@dataclass
class _Chat:
    """One admitted chat request: what every response builder needs."""

    engine: EngineClient
    jobs: list[Job]
    num_prompt_tokens: int
    top_logprobs: int | None  # None: no logprobs asked
    id: str
    created: int

    def logprobs(self, out: RequestOutput | Choice) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(self.engine.tokenizer, list(out.logprobs))

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.engine.model_name, "choices": choices, **extra}


def _prepare(engine: EngineClient, req: ChatCompletionRequest, limits: ServerLimits) -> _Chat:
    """Validate everything before any work starts, so bad input is a clean 400."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, top_logprobs)
    prompt = render_chat(engine, req.messages, req.add_generation_prompt, req.continue_final_message,
                         req.chat_template_kwargs)
    limits.check_tokens([len(prompt)], req.n, param="messages")
    jobs = fan_out([prompt], params)
    engine.validate(prompt, jobs[0].params)
    return _Chat(engine, jobs, len(prompt), top_logprobs, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))


async def create_chat_completion(engine: EngineClient, req: ChatCompletionRequest, http: HTTPRequest) -> Any:
    stream_usage = StreamUsage.of(req)
    c = await off_loop_if_large(http, _prepare, engine, req, limits_of(http))
    if req.stream:
        return SSEResponse(sse_stream(_stream_chunks(c, stream_usage)))
    choices = await collect_choices(engine, c.id, c.jobs, http)
    return JSONResponse(_full_body(c, choices))


def _full_body(c: _Chat, choices: list[Choice]) -> dict[str, Any]:
    return {
        "id": c.id, "object": "chat.completion", "created": c.created, "model": c.engine.model_name,
        "choices": [
            {
                "index": ch.index,
                "message": {"role": "assistant", "content": ch.text},
                "logprobs": c.logprobs(ch),
                "finish_reason": ch.finish_reason,
                "stop_reason": ch.stop_reason,
            }
            for ch in choices
        ],
        "usage": usage(c.num_prompt_tokens, sum(len(ch.token_ids) for ch in choices)),
    }


def _delta_choices(c: _Chat, job: Job, out: RequestOutput) -> list[dict[str, Any]]:
    """The chunks one increment becomes: its content (if any), then, when it is the
    last, a separate finish chunk with an empty delta, as OpenAI sends it."""
    choices: list[dict[str, Any]] = []
    if out.text or out.logprobs:
        choices.append({"index": job.index, "delta": {"content": out.text}, "logprobs": c.logprobs(out),
                        "finish_reason": None})
    if out.finished:
        choices.append({"index": job.index, "delta": {}, "logprobs": None,
                        "finish_reason": out.finish_reason.value if out.finish_reason else None,
                        "stop_reason": out.stop_reason})
    return choices


async def _stream_chunks(c: _Chat, stream_usage: StreamUsage) -> AsyncGenerator[dict[str, Any], None]:
    def per_chunk(completion_tokens: int) -> dict[str, Any]:
        return stream_usage.per_chunk(c.num_prompt_tokens, completion_tokens)

    for job in c.jobs:  # the role comes first, before any engine work
        yield c.chunk([{"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}], **per_chunk(0))
    completion_tokens = 0
    async with aclosing(merged_outputs(c.engine, c.id, c.jobs)) as outputs:
        async for job, out in outputs:
            completion_tokens += len(out.new_token_ids)
            for choice in _delta_choices(c, job, out):
                yield c.chunk([choice], **per_chunk(completion_tokens))
    if stream_usage.final:
        yield c.chunk([], usage=usage(c.num_prompt_tokens, completion_tokens))
