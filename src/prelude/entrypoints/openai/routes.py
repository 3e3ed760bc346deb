"""The model-running POST routes: url -> request model and handler. The HTTP app and
the batch runner (`prelude run-batch`, /v1/batches) dispatch through this one table, so
a batch line gets the answer the route would have given its body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from pydantic import BaseModel

from prelude.entrypoints.openai.decision_protocol import DecisionRequest, SystemOneRequest
from prelude.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerativeScoringRequest,
    RerankRequest,
    RewardRequest,
    ScoreRequest,
)
from prelude.entrypoints.openai.serving_chat import create_chat_completion
from prelude.entrypoints.openai.serving_completions import create_completion
from prelude.entrypoints.openai.serving_pooling import (
    create_classification,
    create_embeddings,
    create_rerank,
    create_reward,
    create_score,
)
from prelude.entrypoints.openai.serving_decisions import create_decision, create_systemone
from prelude.entrypoints.openai.serving_generative_score import create_generative_score, create_generative_scoring

Handler = Callable[[Any, Any, Any], Awaitable[Any]]  # (engine, validated body, HTTP request) -> answer


@dataclass(frozen=True)
class Route:
    body: type[BaseModel]
    pick: Callable[[Any], Handler]  # the handler for one validated body

    def handler(self, body: BaseModel) -> Handler:
        return self.pick(body)


def _always(handler: Handler) -> Callable[[Any], Handler]:
    return lambda _body: handler


ROUTES: dict[str, Route] = {
    "/v1/completions": Route(CompletionRequest, _always(create_completion)),
    "/v1/chat/completions": Route(ChatCompletionRequest, _always(create_chat_completion)),
    "/v1/embeddings": Route(EmbeddingRequest, _always(create_embeddings)),
    "/v1/classify": Route(ClassifyRequest, _always(create_classification)),
    "/v1/score": Route(ScoreRequest, lambda b: create_generative_score if b.is_generative else create_score),
    "/v1/generative_scoring": Route(GenerativeScoringRequest, _always(create_generative_scoring)),
    "/v1/rerank": Route(RerankRequest, _always(create_rerank)),
    "/v1/reward": Route(RewardRequest, _always(create_reward)),
    "/v1/decisions": Route(DecisionRequest, _always(create_decision)),
    "/v1/systemone": Route(SystemOneRequest, _always(create_systemone)),
}
# The unversioned spellings the server also answers (vLLM's).
ROUTES |= {url.removeprefix("/v1"): ROUTES[url] for url in
           ("/v1/classify", "/v1/score", "/v1/generative_scoring", "/v1/rerank", "/v1/reward")}
