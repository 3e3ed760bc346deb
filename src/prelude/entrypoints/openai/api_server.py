"""The FastAPI app: routes, auth, model-name checks. The engine sits behind EngineClient."""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

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
from prelude.entrypoints.openai.serving_pooling import (
    create_classification,
    create_embeddings,
    create_rerank,
    create_reward,
    create_score,
)
from prelude.entrypoints.openai.serving_chat import create_chat_completion, render_chat
from prelude.entrypoints.openai.serving_completions import create_completion

VERSION = "0.1.0"


def _check_model(engine: EngineClient, name: str | None) -> None:
    if name is not None and name != engine.model_name:
        raise APIError(f"The model `{name}` does not exist. This server serves `{engine.model_name}`.",
                       param="model", code="model_not_found")


def build_app(engine: EngineClient, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="Prelude", version=VERSION)
    install_error_handlers(app)
    created = int(time.time())

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response("invalid or missing API key", 401)
        return await call_next(request)

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(engine, body.model)
        try:
            return await create_completion(engine, body, request)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(engine, body.model)
        try:
            return await create_chat_completion(engine, body, request)
        except ClientDisconnected:
            return Response(status_code=499)

    async def _pooled(handler: Any, body: Any, request: Request) -> Any:
        _check_model(engine, body.model)
        try:
            return await handler(engine, body, request)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await _pooled(create_embeddings, body, request)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest, request: Request) -> Any:
        return await _pooled(create_classification, body, request)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Any:
        return await _pooled(create_score, body, request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Any:
        return await _pooled(create_rerank, body, request)

    @app.post("/reward")
    @app.post("/v1/reward")
    async def reward(body: RewardRequest, request: Request) -> Any:
        return await _pooled(create_reward, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(engine, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages")
        if body.messages is not None:
            tokens = render_chat(engine, body.messages, body.add_generation_prompt)
        else:
            tokens = engine.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        _check_model(engine, body.model)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is out of vocabulary (size {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
