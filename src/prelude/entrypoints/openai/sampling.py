"""Request fields -> SamplingParams, and logprob formatting shared by both APIs."""

from __future__ import annotations

from typing import Any

from prelude.engine.request import SamplingParams, TokenLogprob
from prelude.entrypoints.openai.protocol import _SamplingFields
from prelude.entrypoints.openai.structured import structured_output
from prelude.tokenizer.base import Tokenizer


def sampling_params(
    req: _SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """Defaults follow OpenAI (temperature 1, top_p 1); SamplingParams validates ranges."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        prompt_logprobs=prompt_logprobs,
        ttft_slo_ms=req.ttft_slo_ms,
        structured=structured_output(req),
    )


def completion_logprobs(
    tok: Tokenizer, lps: list[TokenLogprob | None], offset: int, token_ids: list[int] | None = None
) -> dict[str, Any]:
    """Legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset.

    A None entry (the first prompt token under echo) has a null logprob; its token comes
    from `token_ids`. The sampled/actual token is always among a row's top logprobs,
    as OpenAI returns it.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    for i, lp in enumerate(lps):
        token_id = lp.token_id if lp is not None else (token_ids or [])[i]
        text = tok.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(lp.logprob)
        top = {tok.token_text(t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)  # `logprobs: 0` too: the sampled token alone (as vLLM)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_payload(tok: Tokenizer, lps: tuple[TokenLogprob | None, ...]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token {token_id: {logprob, rank, decoded_token}}."""
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": tok.token_text(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": tok.token_text(t)})
        out.append(entry)
    return out


def _entry(tok: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tok.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {**_entry(tok, lp.token_id, lp.logprob), "top_logprobs": [_entry(tok, t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
