"""Requests as the engine sees them: sampling parameters, per-request state, outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the server answers it with HTTP 400."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled. `n > 1` is fanned out by the front end into n requests."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; 0 = only the sampled one
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt token (k=0: only the actual token)
    ttft_slo_ms: float | None = None  # time-to-first-token target (deadline-aware scheduling, SLO metrics)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise SamplingParamsError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise SamplingParamsError(f"max_tokens must be at least 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingParamsError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.ttft_slo_ms is not None and self.ttft_slo_ms <= 0:
            raise SamplingParamsError(f"ttft_slo_ms must be positive, got {self.ttft_slo_ms}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


class ExecClass(enum.Enum):
    """The resource contract of a request, fixed once at admission."""

    ONESHOT = "oneshot"  # one forward, fixed-size output, no KV kept
    DECODE = "decode"  # multi-token generation on paged KV


class PoolingTask(str, enum.Enum):
    EMBED = "embed"  # pooled hidden state
    CLASSIFY = "classify"  # the model's classification / score / reward head
    LABELS = "labels"  # next-token logprobs of candidate label tokens after the prompt


@dataclass(frozen=True)
class PoolingParams:
    """What a fixed-output (non-generation) request wants from its one forward."""

    task: PoolingTask
    pooling: str | None = None  # last | mean | cls; None: the model's default
    normalize: bool = False
    label_token_ids: tuple[int, ...] = ()
    token_type_ids: tuple[int, ...] | None = None  # sentence pairs for BERT-style encoders

    def __post_init__(self) -> None:
        if self.pooling not in (None, "last", "mean", "cls"):
            raise SamplingParamsError(f"pooling must be last, mean or cls, got {self.pooling!r}")
        if self.task is PoolingTask.LABELS and not self.label_token_ids:
            raise SamplingParamsError("label classification needs at least one label")


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
class TokenLogprob:
    """Logprob of one generated token and the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 = the most likely token (computed for prompt logprobs)


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


@dataclass
class Request:
    """Engine-side state of one sequence. Mutated only by the engine thread."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_output_tokens: int  # effective budget (max_tokens clamped to the context)
    eos_token_ids: frozenset[int] = frozenset()  # empty when ignore_eos
    generator: torch.Generator | None = None
    exec_class: ExecClass = ExecClass.DECODE
    pooling: PoolingParams | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    head_done: bool = False  # prompt logprobs / pooled outputs already delivered
    deferred_steps: int = 0  # steps waited for a leader to fill a shared cold prefix
    ttft_deadline: float | None = None  # absolute (monotonic) time the first token is due
    first_token_time: float | None = None
    finish_time: float | None = None
    # MLFQ decode state (see engine/policies/mlfq.py)
    mlfq_level: int = 0
    mlfq_used: int = 0
    mlfq_starved_steps: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
