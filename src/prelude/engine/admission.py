"""Prepare a request once: validate its tokens and budget, seed its sampler."""

from __future__ import annotations

import time

import torch

from prelude.engine.client import AdmissionError
from prelude.engine.request import Request, SamplingParams


def admit(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    eos_token_ids: frozenset[int],
    shared_generator: torch.Generator,
    arrival_time: float | None = None,
) -> Request:
    """Build the engine-side Request or raise AdmissionError with a user-facing message."""
    if params.n != 1:
        raise AdmissionError("the engine takes one sequence per request; fan out n > 1 before admission")
    n_prompt = len(prompt_token_ids)
    if n_prompt == 0:
        raise AdmissionError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise AdmissionError(f"token id {bad[0]} is out of vocabulary (size {vocab_size})")
    if n_prompt >= max_model_len:
        raise AdmissionError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{n_prompt} tokens, leaving no room for output. Please reduce the length of the prompt."
        )
    room = max_model_len - n_prompt
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise AdmissionError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or the completion."
        )
    generator = shared_generator
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        params=params,
        arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        max_output_tokens=max_tokens,
        eos_token_ids=frozenset() if params.ignore_eos else eos_token_ids,
        generator=generator,
    )
