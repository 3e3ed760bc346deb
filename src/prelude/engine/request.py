"""Requests as the engine sees them: sampling parameters, per-request state, outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# Re-exported: the server and the offline API import them from here.
from prelude.params import (  # noqa: F401
    LoraRequest,
    PoolingParams,
    PoolingTask,
    SamplingParams,
    SamplingParamsError,
    StructuredOutput,
    TokenLogprob,
)


class ExecClass(enum.Enum):
    """The resource contract of a request, fixed once at validation."""

    ONESHOT = "oneshot"  # one forward, fixed-size output, no KV kept
    PAGED = "paged"  # multi-token generation on paged KV, prompt included


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestOutput:
    """One step's increment of one request. The front end accumulates increments.

    `text` is the new detokenized text since the previous increment (stop strings
    already removed, text that may still become a stop string held back).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    # OneShot payloads (None when not asked for):
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first prompt token: None
    embedding: tuple[float, ...] | None = None
    scores: tuple[float, ...] | None = None  # raw head outputs, or label-token logprobs
    exec_class: ExecClass | None = None  # the class validation picked (None: a test double's output)
    num_cached_tokens: int = 0  # prompt tokens a OneShot row took from the prefix cache


@dataclass(eq=False)
class Request:
    """Engine-side state of one sequence. Mutated only by the engine thread.

    Compared by identity (eq=False): one object per sequence, and the scheduler's list
    membership tests (`in`, `remove`) on a generated field-by-field __eq__ built two
    30-field tuples per comparison, O(rows^2) of them per decode step."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_output_tokens: int  # effective budget (max_tokens clamped to the context)
    eos_token_ids: frozenset[int] = frozenset()  # empty when ignore_eos
    sampling_seed: int = 0  # params.seed, or drawn from the engine's seed source at validation
    exec_class: ExecClass = ExecClass.PAGED
    pooling: PoolingParams | None = None
    lora: LoraRequest | None = None  # the LoRA adapter it runs with (None: the base model)
    grammar: Any = None  # structured outputs: the engine.grammar.GrammarMatcher of this request
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # OneShot: prompt tokens its row took from the prefix cache (or a leader)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    head_done: bool = False  # prompt logprobs / pooled outputs already delivered
    deferred_steps: int = 0  # steps waited for a leader to fill a shared cold prefix
    # Mean/max pooling in chunks: prompt tokens pooled so far (their blocks published to the
    # prefix cache) and their running pool (HeadSpec.pooled_before)
    pooled_upto: int = 0
    pooled: tuple[float, ...] | None = None
    hand_off: bool = False  # disaggregated prefill: export the KV after the first token, decode elsewhere
    ttft_deadline: float | None = None  # absolute (monotonic) time the first token is due
    scheduled_time: float | None = None  # first taken into a step (queue time ends)
    first_token_time: float | None = None
    finish_time: float | None = None
    # MLFQ decode state (see engine/policies/mlfq.py)
    mlfq_level: int = 0
    mlfq_used: int = 0
    mlfq_starved_steps: int = 0
    trace: Any = None  # stage_trace.StageTrace of a traced request (`--trace-stages`), else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def low_priority(self) -> bool:
        """A /v1/batches line: it yields to the other (normal) requests."""
        return self.params.low_priority or (self.pooling is not None and self.pooling.low_priority)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
