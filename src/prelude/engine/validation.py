"""Request validation: prepare a request once: validate its tokens and budget, seed its sampler, and pick
its execution class (the resource contract it keeps for its whole life)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

from prelude.engine.client import InvalidRequestError
from prelude.engine.request import ExecClass, LoraRequest, PoolingParams, PoolingTask, Request, SamplingParams
from prelude.params import EmbedSetup


def pick_exec_class(params: SamplingParams, max_tokens: int, pooling: PoolingParams | None) -> ExecClass:
    """OneShot: one forward and a fixed-size output (a pooled vector, head scores,
    prompt logprobs, or at most one generated token). Everything else is Paged."""
    if pooling is not None or max_tokens <= 1:
        return ExecClass.ONESHOT
    return ExecClass.PAGED


@dataclass(frozen=True)
class RequestRules:
    """What validation checks a request against and fills in: the served model's facts and
    the operator's defaults. The engine builds it once; a scale-out front gets the same
    object from a replica, so both validate alike."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    can_generate: bool = True
    force_paged: bool = False
    labels: tuple[str, ...] = ()
    default_pooling: str | None = None
    default_ttft_slo_ms: float | None = None
    lora_enabled: bool = False  # adapter slots exist (--max-loras)
    embed: EmbedSetup | None = None  # what the model's embeddings are (None: nothing checked)
    score_template: str | None = None  # a token reranker's prompt template (the score routes apply it)


def validate_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    rules: RequestRules,
    *,
    seed_source: random.Random,
    pooling: PoolingParams | None = None,
    arrival_time: float | None = None,
    lora: LoraRequest | None = None,
) -> Request:
    """Build the engine-side Request or raise InvalidRequestError with a user-facing message.
    The model's defaults (pooling, TTFT target) are filled in here, once, for every front."""
    if pooling is not None and pooling.task is PoolingTask.CLASSIFY and not rules.labels:
        raise InvalidRequestError("this model has no classification head; pass candidate labels instead")
    if pooling is not None and pooling.dimensions is not None:
        if pooling.task is not PoolingTask.EMBED:
            raise InvalidRequestError("dimensions applies to embeddings only")
        why = rules.embed.check_dimensions(pooling.dimensions) if rules.embed is not None else None
        if why is not None:
            raise InvalidRequestError(why)
    if pooling is not None and pooling.pooling is None and rules.default_pooling is not None:
        pooling = replace(pooling, pooling=rules.default_pooling)
    if params.ttft_slo_ms is None and rules.default_ttft_slo_ms is not None:
        params = replace(params, ttft_slo_ms=rules.default_ttft_slo_ms)
    if lora is not None and not rules.lora_enabled:
        raise InvalidRequestError(f"LoRA adapter {lora.name!r} requested but this server runs without LoRA")
    if params.n != 1:
        raise InvalidRequestError("the engine takes one sequence per request; fan out n > 1 before validation")
    if pooling is None and not rules.can_generate:
        raise InvalidRequestError("this model does not generate text; use /v1/embeddings, /classify or /score")
    n_prompt = len(prompt_token_ids)
    if n_prompt == 0:
        raise InvalidRequestError("the prompt is empty")
    # min/max scan at C speed (a Python loop over a long prompt was a visible share of a
    # batch line's host work); the slow scan only names the first bad id.
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= rules.vocab_size:
        bad = next(t for t in prompt_token_ids if not 0 <= t < rules.vocab_size)
        raise InvalidRequestError(f"token id {bad} is out of vocabulary (size {rules.vocab_size})")
    if pooling is not None:
        bad = [t for t in pooling.label_token_ids if not 0 <= t < rules.vocab_size]
        if bad:
            raise InvalidRequestError(f"label token id {bad[0]} is out of vocabulary (size {rules.vocab_size})")
        max_tokens = 0
        if n_prompt > rules.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {rules.max_model_len} tokens. However, the input has "
                f"{n_prompt} tokens. Please reduce the length of the input."
            )
    else:
        if n_prompt >= rules.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {rules.max_model_len} tokens. However, your prompt has "
                f"{n_prompt} tokens, leaving no room for output. Please reduce the length of the prompt."
            )
        room = rules.max_model_len - n_prompt
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {rules.max_model_len} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or the completion."
            )
    multi_item = pooling is not None and bool(pooling.item_lens)
    if multi_item:
        assert pooling is not None
        shared = pooling.shared_len(n_prompt)
        if shared < 1:
            raise InvalidRequestError("packed items need a non-empty shared prompt before them")
    exec_class = pick_exec_class(params, max_tokens, pooling)
    if rules.force_paged and rules.can_generate and not multi_item:  # multi-item prompts exist only as OneShot rows
        exec_class = ExecClass.PAGED  # ablation: everything takes the paged path
    # A request without a seed draws one from the engine's seeded source: runs of the
    # same traffic repeat, and the sampler needs no generator object per request.
    seed = params.seed if params.seed is not None else seed_source.getrandbits(62)
    seed = (seed + 2**63) % 2**64 - 2**63  # its 64 bits as the sampler's int64 (two's complement)
    arrival = time.monotonic() if arrival_time is None else arrival_time
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        params=params,
        arrival_time=arrival,
        ttft_deadline=arrival + params.ttft_slo_ms / 1000 if params.ttft_slo_ms else None,
        max_output_tokens=max_tokens,
        eos_token_ids=frozenset() if params.ignore_eos else rules.eos_token_ids,
        sampling_seed=seed,
        exec_class=exec_class,
        pooling=pooling,
        lora=lora,
    )
