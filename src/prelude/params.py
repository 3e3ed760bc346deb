"""Value types a request carries from the API down to the executor.

A leaf module: it imports nothing from prelude, so the engine, the executor and the
server can all share these types without importing each other.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the server answers it with HTTP 400."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, compiled by the engine (llguidance).

    kind: json (a JSON schema, `spec` its JSON text), json_object (any JSON object),
    regex, choice (`spec`: a JSON list of strings), grammar (Lark or GBNF text)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_object", "regex", "choice", "grammar"):
            raise SamplingParamsError(f"unknown structured output kind {self.kind!r}")


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
    structured: StructuredOutput | None = None  # constrained decoding (JSON schema, regex, choice, grammar)
    # A /v1/batches line: scheduled behind every normal request
    # (SchedulerConfig.low_priority_step_tokens).
    low_priority: bool = False

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
        if not 0 < self.repetition_penalty < math.inf:  # NaN fails too (it passed `<= 0` and broke the logits)
            raise SamplingParamsError(f"repetition_penalty must be positive and finite, got {self.repetition_penalty}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise SamplingParamsError(f"seed must be a 64-bit integer, got {self.seed}")
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


class PoolingTask(str, enum.Enum):
    EMBED = "embed"  # pooled hidden state
    CLASSIFY = "classify"  # the model's classification / score / reward head
    LABELS = "labels"  # next-token logprobs of candidate label tokens after the prompt (or after each item)
    # Teacher-forced logprob of each item's whole token sequence after the shared prompt:
    # whole-label classification, the labels as the items of a multi-item prompt (see PoolingParams.item_lens).
    SEQUENCE_LOGPROBS = "sequence_logprobs"


@dataclass(frozen=True)
class PoolingParams:
    """What a fixed-output (non-generation) request wants from its one forward."""

    task: PoolingTask
    pooling: str | None = None  # last | mean | cls | max; None: the model's default
    normalize: bool = False
    # EMBED: leading tokens (an instruction prompt) left out of the pooled ones, where the
    # model's Pooling module excludes its prompt (include_prompt false)
    skip_tokens: int = 0
    dimensions: int | None = None  # EMBED: a Matryoshka cut of the vector (before normalizing)
    label_token_ids: tuple[int, ...] = ()
    token_type_ids: tuple[int, ...] | None = None  # sentence pairs for BERT-style encoders
    # Multi-item packing: the prompt is a shared part followed by items of these lengths,
    # each item seeing the shared part and itself only, its positions restarting where the
    # shared part ends; every item gets its own outputs, as if it had been sent alone.
    item_lens: tuple[int, ...] = ()
    # LABELS: log-softmax over the label ids only, from the gathered label rows of the LM
    # head (no full-vocabulary projection); False: full-vocabulary logprobs of the ids.
    label_softmax: bool = False
    low_priority: bool = False  # scheduled behind normal requests, as SamplingParams.low_priority

    def __post_init__(self) -> None:
        if self.pooling not in (None, "last", "mean", "cls", "max"):
            raise SamplingParamsError(f"pooling must be last, mean, cls or max, got {self.pooling!r}")
        if self.skip_tokens < 0:
            raise SamplingParamsError("skip_tokens must be non-negative")
        if self.dimensions is not None and self.dimensions < 1:
            raise SamplingParamsError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.task is PoolingTask.LABELS and not self.label_token_ids:
            raise SamplingParamsError("label classification needs at least one label")
        if self.task is PoolingTask.SEQUENCE_LOGPROBS and not self.item_lens:
            raise SamplingParamsError("sequence logprobs need at least one item")
        if any(n < 1 for n in self.item_lens):
            raise SamplingParamsError("every item needs at least one token")
        if self.item_lens and self.task not in (PoolingTask.LABELS, PoolingTask.SEQUENCE_LOGPROBS):
            raise SamplingParamsError("items are packed for label and sequence scoring only")

    def shared_len(self, num_prompt_tokens: int) -> int:
        """Tokens of the shared part of a multi-item prompt (all of it without items)."""
        return num_prompt_tokens - sum(self.item_lens)


@dataclass(frozen=True)
class EmbedSetup:
    """What a model's embeddings are, as its sentence-transformers folder and config say:
    the fronts pick prompts and check `dimensions` with it."""

    dimension: int  # the vector's size (the last Dense layer's, else the hidden size)
    prompts: tuple[tuple[str, str], ...] = ()  # (name, text) prepended to a text input
    default_prompt_name: str | None = None
    include_prompt: bool = True  # False: a prompt's tokens are left out of the pooled ones
    normalize: bool = True  # the default of a request's `normalize`
    # Sizes a vector may be cut to: None where the checkpoint declares none (a cut is
    # refused), () where any size up to `dimension` is declared
    matryoshka: tuple[int, ...] | None = None

    def prompt(self, name: str | None) -> str | None:
        """The text of prompt `name` (None: the default prompt, if any); KeyError where no
        prompt has that name."""
        name = name if name is not None else self.default_prompt_name
        if name is None:
            return None
        return dict(self.prompts)[name]

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why `dimensions` cannot be served (None: it can)."""
        if self.matryoshka is None:
            return ("dimensions is not supported: this model declares no Matryoshka sizes (its vectors cut "
                    "short would not be embeddings it was trained to give)")
        if not 1 <= dimensions <= self.dimension:
            return f"dimensions must be between 1 and {self.dimension}, got {dimensions}"
        if self.matryoshka and dimensions not in self.matryoshka:
            return f"dimensions must be one of {', '.join(map(str, self.matryoshka))}, got {dimensions}"
        return None


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one generated token and the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 = the most likely token (computed for prompt logprobs)


@dataclass(frozen=True)
class LoraRequest:
    """The LoRA adapter a request runs with: its served name, its PEFT directory, and an id
    unique to this load of it (a name unloaded and loaded again gets a new id, so nothing
    computed under the old adapter, cached KV included, is reused)."""

    name: str
    path: str
    id: int
