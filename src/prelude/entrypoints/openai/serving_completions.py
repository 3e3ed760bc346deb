"""POST /v1/completions."""

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
from prelude.entrypoints.openai.protocol import CompletionRequest
from prelude.entrypoints.openai.sampling import (
    completion_logprobs,
    prompt_logprobs_payload,
    sampling_params,
    usage,
)


def _prompts(engine: EngineClient, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids and texts of each prompt (str, [str], [int] or [[int]])."""
    p = req.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif not p:
        raise APIError("prompt must not be empty", param="prompt")
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    tok = engine.tokenizer
    ids, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids.append(tok.encode(item, add_special_tokens=True))
            texts.append(item)
        else:
            if not item:
                raise APIError("a token-id prompt must not be empty", param="prompt")
            ids.append(list(item))
            texts.append(tok.decode(item, skip_special_tokens=False) if req.echo else "")
    return ids, texts


async def create_completion(engine: EngineClient, req: CompletionRequest, http: HTTPRequest) -> Any:
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    # echo + logprobs returns the prompt's logprobs too (lm-eval's loglikelihood path).
    echo_logprobs = req.echo and req.logprobs is not None
    prompt_k = req.prompt_logprobs
    if echo_logprobs:
        prompt_k = max(prompt_k or 0, req.logprobs or 0)
    params = sampling_params(req, req.max_tokens, req.logprobs, prompt_k)
    prompt_ids, prompt_texts = _prompts(engine, req)
    jobs = fan_out(prompt_ids, params)
    for job in jobs[:: params.n]:  # one check per prompt, before any work starts
        engine.validate(job.prompt_ids, job.params)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n_prompt = sum(len(ids) for ids in prompt_ids)
    tok = engine.tokenizer

    def echo_text(prompt_index: int) -> str:
        return prompt_texts[prompt_index] if req.echo else ""

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            completion_tokens = 0
            offsets = {j.index: len(echo_text(j.prompt_index)) for j in jobs}
            sent_echo: set[int] = set()
            async for job, out in merged_outputs(engine, rid, jobs):
                text = out.text
                first = job.index not in sent_echo
                sent_echo.add(job.index)
                if req.echo and first:
                    text = echo_text(job.prompt_index) + text
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(tok, list(out.logprobs), offsets[job.index])
                    offsets[job.index] += sum(len(t) for t in lp["tokens"])
                    if echo_logprobs and first and out.prompt_logprobs is not None:
                        head = completion_logprobs(tok, list(out.prompt_logprobs), 0, job.prompt_ids)
                        lp = {k: head[k] + lp[k] for k in lp}
                completion_tokens += len(out.new_token_ids)
                choice = {
                    "index": job.index, "text": text, "logprobs": lp,
                    "finish_reason": out.finish_reason.value if out.finish_reason else None,
                    "stop_reason": out.stop_reason,
                }
                if req.prompt_logprobs is not None and first:
                    choice["prompt_logprobs"] = prompt_logprobs_payload(tok, out.prompt_logprobs or ())
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
                         "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                final = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
                         "choices": [], "usage": usage(n_prompt, completion_tokens)}
                yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    choices = await collect_choices(engine, rid, jobs, http)
    body_choices = []
    for job, c in zip(jobs, choices):
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(tok, list(c.logprobs), len(echo_text(job.prompt_index)))
            if echo_logprobs and c.prompt_logprobs is not None:
                head = completion_logprobs(tok, list(c.prompt_logprobs), 0, job.prompt_ids)
                lp = {k: head[k] + lp[k] for k in lp}
        choice: dict[str, Any] = {
            "index": c.index, "text": echo_text(job.prompt_index) + c.text, "logprobs": lp,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        }
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_payload(tok, c.prompt_logprobs or ())
        body_choices.append(choice)
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
        "choices": body_choices,
        "usage": usage(n_prompt, sum(len(c.token_ids) for c in choices)),
    })
