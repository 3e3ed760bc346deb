"""Request models of the OpenAI-compatible API (pydantic). Unknown fields are kept in
`model_extra` and judged by fields.py (refused when they would change the answer's
meaning, otherwise ignored with a warning); known fields of the wrong type or out of
range are rejected with a 400."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# JSON may spell a lone UTF-16 surrogate ("\ud800"); Python then holds a str that no
# tokenizer can take and that cannot even be written back out as UTF-8.
_SURROGATE = re.compile("[\ud800-\udfff]")
UNENCODABLE_TEXT = "unencodable_text"  # the validation error type the error handler names
_NUMBERS = {int, float, bool, type(None)}


def first_unencodable(value: Any, path: str = "") -> tuple[str, str] | None:
    """(dotted path, character) of the first string in a JSON value holding a surrogate."""
    if isinstance(value, str):
        if value.isascii():  # O(1) in CPython: the common case costs no scan
            return None
        found = _SURROGATE.search(value)
        return (path, found.group()) if found else None
    if isinstance(value, dict):
        for key, item in value.items():
            # The path goes into the error body: a surrogate in a key is spelled out escaped.
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
            sub = f"{path}.{name}" if path else name
            hit = first_unencodable(key, sub) or first_unencodable(item, sub)
            if hit:
                return hit
    elif isinstance(value, list):
        if set(map(type, value)) <= _NUMBERS:  # token ids: one C-level pass, no Python loop
            return None
        for i, item in enumerate(value):
            hit = first_unencodable(item, f"{path}.{i}" if path else str(i))
            if hit:
                return hit
    return None


class RequestBody(BaseModel):
    """A JSON request body's model: unknown fields kept, no lone surrogate in any text."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _utf8_text_only(cls, data: Any) -> Any:
        # Every route's text is checked here, once, before any field sees it: the error
        # names the field (a nested model re-checks its part, which is then clean).
        hit = first_unencodable(data)
        if hit is not None:
            raise PydanticCustomError(
                UNENCODABLE_TEXT,
                "{param}: the text holds a lone surrogate (U+{code}), which is not a Unicode character "
                "and cannot be encoded as UTF-8",
                {"param": hit[0] or "body", "code": f"{ord(hit[1]):04X}"},
            )
        return data


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the running usage


class _SamplingFields(RequestBody):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(default=1, ge=1, le=128)
    seed: int | None = Field(default=None, ge=0, lt=2**64)  # a torch generator seed
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    ttft_slo_ms: float | None = Field(default=None, gt=0)
    # structured outputs (vLLM's fields, see structured.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # explicit null: up to the context length
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None  # accepted only as null: insertion is not supported
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=0)  # legacy name; max_completion_tokens wins
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: a chat template already holds its specials
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# list[int] before list[str]: pydantic's smart union picks the same member either way, but
# tries members in order, and a long token-id list tried as list[str] first collects one
# error per id (many times the validation time of a long prompt, all of it holding the GIL).
EmbeddingInput = str | list[int] | list[str] | list[list[int]]


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: Literal["last", "mean", "cls", "max"] | None = None
    # None: as the model's folder says (its Normalize module), normalized without a folder
    normalize: bool | None = None
    # sentence-transformers' name of a prompt in the model's config_sentence_transformers.json
    # (None: its default prompt, if any), prepended to each text input
    prompt_name: str | None = None


class ClassifyRequest(RequestBody):
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    labels: list[str] | None = None  # whole-label classification for causal LMs
    # How a label's token logprobs combine: their sum (the label's logprob) or their mean.
    normalize: Literal["sum", "mean"] = "sum"
    use_chat_template: bool = False  # wrap each input as a user turn of the chat template
    # What turns a head's outputs into `probs` (None: sigmoid for one output, softmax for
    # several, softmax over candidate labels); "none": the raw logits (labels: logprobs)
    activation: Literal["softmax", "sigmoid", "none"] | None = None
    user: str | None = None


class ScoreRequest(RequestBody):
    """Two shapes on one route, told apart by their fields: vLLM's cross-encoder pairs
    (`text_1`, `text_2`) and SGLang's generative scoring (`query`, `items`,
    `label_token_ids`)."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    template: str | None = None
    # a token reranker's task text inside its own template (Qwen3-Reranker's <Instruct>)
    instruction: str | None = None
    user: str | None = None
    # SGLang's shape
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    # Prelude: pack the items after the query into one forward (False: one row per item)
    multi_item: bool = True

    @property
    def is_generative(self) -> bool:
        return self.query is not None or self.items is not None or self.label_token_ids is not None


class GenerativeScoringRequest(RequestBody):
    """vLLM's /generative_scoring: P(label_token_ids[0]) for each query+item."""

    model: str | None = None
    query: str | list[int]
    items: list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    multi_item: bool = True
    user: str | None = None


class RerankRequest(RequestBody):
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    template: str | None = None
    instruction: str | None = None  # a token reranker's task text inside its own template
    user: str | None = None


class RewardRequest(RequestBody):
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    activation: Literal["sigmoid", "none"] = "none"  # the score as the head gives it, or its sigmoid
    user: str | None = None
