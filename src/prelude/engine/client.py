"""The engine surface the HTTP server talks to (implemented by engine.async_engine.AsyncEngine)."""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from prelude.engine.metrics import RequestMetrics
from prelude.engine.request import PoolingParams, RequestOutput, SamplingParams
from prelude.params import EmbedSetup
from prelude.tokenizer.base import Tokenizer


class InvalidRequestError(ValueError):
    """A request is invalid for this engine (e.g. prompt longer than the context): HTTP 400."""


AdmissionError = InvalidRequestError  # the old name, kept while branches written before the rename land


class EngineUnavailableError(RuntimeError):
    """No engine can take or finish the request now (e.g. a scale-out replica died
    mid-stream, or none is alive): HTTP 503, the client may retry."""


class ReplicaLostError(EngineUnavailableError):
    """The replica serving a request died after the request had produced output. What it
    produced is void; a consumer that has sent none of it to its client (a non-streamed
    answer) runs the request again from the start, a started stream ends with an error."""


class EngineClient(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def labels(self) -> tuple[str, ...]:
        """Output names of the model's classification head; empty if it has none."""
        ...

    @property
    def can_generate(self) -> bool: ...

    @property
    def is_encoder(self) -> bool: ...

    @property
    def embed_setup(self) -> EmbedSetup | None:
        """What the model's embeddings are: prompts, size, Matryoshka sizes (None: unknown)."""
        ...

    @property
    def score_template(self) -> str | None:
        """A token reranker's prompt template, which /v1/score and /v1/rerank apply."""
        ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream one sequence's increments; the last one has finished=True.

        Raises InvalidRequestError before the first increment if the request is
        invalid. Closing the iterator early (client gone) aborts the request and frees
        its KV blocks. `params.n` must be 1: the caller fans out n > 1.
        """
        ...

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams) -> RequestOutput:
        """A fixed-size result of one forward (OneShot): embedding, head scores, label logprobs."""
        ...

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams | None = None
    ) -> None:
        """Raise InvalidRequestError if generate() would refuse this request (no side effects)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def metrics(self) -> dict[str, float]:
        """Engine counters (KV blocks, prefix-cache reuse) for GET /metrics."""
        ...

    def request_metrics(self) -> list[RequestMetrics]:
        """Latency records of recently finished requests (TTFT, TPOT, JCT, SLO)."""
        ...
