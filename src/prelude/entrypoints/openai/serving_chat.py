"""POST /v1/chat/completions: the model's chat template, then the same engine path."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from prelude.engine.client import EngineClient
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.fanout import collect_choices, fan_out, merged_outputs
from prelude.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from prelude.entrypoints.openai.sampling import chat_logprobs, sampling_params, usage


def _content_text(msg: ChatMessage, i: int) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for part in msg.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(f"messages[{i}]: only text content parts are supported", param=f"messages.{i}.content")
        parts.append(part["text"])
    return "\n".join(parts)


def render_chat(engine: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Chat prompt token ids (the template already holds any BOS, so none is added)."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    plain = [{"role": m.role, "content": _content_text(m, i)} for i, m in enumerate(messages)]
    try:
        text = engine.tokenizer.apply_chat_template(
            plain, add_generation_prompt=add_generation_prompt and not continue_final, **(template_kwargs or {})
        )
    except ValueError as exc:
        raise APIError(str(exc)) from exc
    except Exception as exc:  # a template's raise_exception() or a render error
        raise APIError(f"chat template error: {exc}") from exc
    if continue_final:
        final = plain[-1]["content"]
        cut = text.rfind(final)
        if plain[-1]["role"] != "assistant" or cut < 0:
            raise APIError("continue_final_message needs a final assistant message", param="messages")
        text = text[: cut + len(final)]
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(engine: EngineClient, req: ChatCompletionRequest, http: HTTPRequest) -> Any:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, logprobs)
    prompt = render_chat(engine, req.messages, req.add_generation_prompt, req.continue_final_message,
                         req.chat_template_kwargs)
    jobs = fan_out([prompt], params)
    engine.validate(prompt, jobs[0].params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    tok = engine.tokenizer

    def chunk(choices: list[dict[str, Any]], usage_value: Any = None, with_usage: bool = False) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": engine.model_name, "choices": choices}
        if with_usage:
            body["usage"] = usage_value
        return f"data: {json.dumps(body)}\n\n"

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            for job in jobs:  # the role comes first, as OpenAI sends it
                yield chunk([{"index": job.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}], with_usage=include_usage)
            completion_tokens = 0
            async for job, out in merged_outputs(engine, rid, jobs):
                completion_tokens += len(out.new_token_ids)
                if not out.text and not out.finished and not out.logprobs:
                    continue
                choice: dict[str, Any] = {
                    "index": job.index,
                    "delta": {"content": out.text} if out.text or not out.finished else {},
                    "logprobs": chat_logprobs(tok, list(out.logprobs)) if logprobs is not None else None,
                    "finish_reason": out.finish_reason.value if out.finish_reason else None,
                }
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                yield chunk([choice], with_usage=include_usage)
            if include_usage:
                yield chunk([], usage(len(prompt), completion_tokens), with_usage=True)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    choices = await collect_choices(engine, rid, jobs, http)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": engine.model_name,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(tok, c.logprobs) if logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ],
        "usage": usage(len(prompt), sum(len(c.token_ids) for c in choices)),
    })
