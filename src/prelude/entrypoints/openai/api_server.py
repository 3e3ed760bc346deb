"""The FastAPI app: routes, auth, model-name checks. The engine sits behind EngineClient."""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from prelude.engine.client import EngineClient
from prelude.entrypoints.openai.errors import APIError, error_response, install_error_handlers
from prelude.entrypoints.openai.fanout import ClientDisconnected
from prelude.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    RewardRequest,
    ScoreRequest,
    TokenizeRequest,
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
from prelude.entrypoints.openai.serving_tokens import detokenize, tokenize

VERSION = "0.1.0"


class BearerAuth:
    """`Authorization: Bearer <key>` on every /v1 route.

    A plain ASGI middleware rather than `@app.middleware("http")`: Starlette's
    BaseHTTPMiddleware re-pipes every streamed chunk through a memory stream and an
    extra task, which costs per token and muddles disconnect handling.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        return secrets.compare_digest(given, self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            response = error_response("invalid or missing API key", 401)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _check_model(engine: EngineClient, name: str | None) -> None:
    """A missing model means the served one; any other name is refused, as OpenAI does."""
    if name is not None and name != engine.model_name:
        raise APIError(f"The model `{name}` does not exist. This server serves `{engine.model_name}`.",
                       param="model", code="model_not_found")


def build_app(engine: EngineClient, api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`; with `api_key`, /v1 routes need it as a bearer token."""
    app = FastAPI(title="Prelude", version=VERSION)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy():
            return JSONResponse({})
        return error_response("the engine loop is not running", 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Prometheus text exposition, written directly: a handful of gauges and counters.
        lines = []
        for name, value in engine.metrics().items():
            kind = "counter" if name.endswith("_total") else "gauge"
            lines.append(f"# TYPE prelude_{name} {kind}")
            lines.append(f"prelude_{name} {value}")
        # fasttoken's safety net: encodes HF answered because the Rust core panicked.
        fallbacks = getattr(engine.tokenizer, "fallback_count", None)
        if fallbacks is not None:
            lines.append("# TYPE prelude_tokenizer_fallbacks_total counter")
            lines.append(f"prelude_tokenizer_fallbacks_total {fallbacks}")
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/request_metrics")
    async def request_metrics() -> dict[str, Any]:
        """Recently finished requests' TTFT/TPOT/JCT/SLO records, for benchmarks."""
        return {"object": "list", "data": [asdict(m) for m in engine.request_metrics()]}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": created, "owned_by": "prelude",
            "root": engine.model_name, "max_model_len": engine.max_model_len,
        }]}

    async def _served(handler: Any, body: Any, request: Request) -> Any:
        """Run one engine-backed handler; a client gone before the answer gets no body."""
        _check_model(engine, body.model)
        try:
            return await handler(engine, body, request)
        except ClientDisconnected:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _served(create_completion, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await _served(create_chat_completion, body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await _served(create_embeddings, body, request)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest, request: Request) -> Any:
        return await _served(create_classification, body, request)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Any:
        return await _served(create_score, body, request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Any:
        return await _served(create_rerank, body, request)

    @app.post("/reward")
    @app.post("/v1/reward")
    async def reward(body: RewardRequest, request: Request) -> Any:
        return await _served(create_reward, body, request)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(engine, body.model)
        return tokenize(engine, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, str]:
        _check_model(engine, body.model)
        return detokenize(engine, body)

    return app


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve `app` with uvicorn until interrupted (blocking)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
