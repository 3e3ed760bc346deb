"""The FastAPI app: routes, auth, model-name checks. The engine sits behind EngineClient."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prelude.engine.client import EngineClient
from prelude.engine.stage_trace import STAGES, mark
from prelude.entrypoints.batch.store import BatchStore
from prelude.entrypoints.batch.worker import BatchRunner, BatchRunnerConfig
from prelude.entrypoints.openai.batch_routes import install_batch_routes
from prelude.entrypoints.openai.drain import DrainingServer
from prelude.entrypoints.openai.errors import APIError, error_response, install_error_handlers
from prelude.entrypoints.openai.decision_protocol import DecisionRequest, SystemOneRequest
from prelude.entrypoints.openai.disconnect import ClientDisconnected
from prelude.entrypoints.openai.fields import check_unknown_fields
from prelude.entrypoints.openai.request_gate import RequestGate, GatedEngine
from prelude.entrypoints.openai.limits import ServerLimits
from prelude.entrypoints.openai.lora_adapters import LoadLoraAdapterRequest, ServedAdapters, UnloadLoraAdapterRequest
from prelude.entrypoints.openai.middleware import BearerAuth, BodySizeLimit
from prelude.entrypoints.openai.offload import OffLoopBodyRoute, json_answer, off_loop_if_large
from prelude.entrypoints.openai.observe import RequestObserver, StageTraces, request_record
from prelude.entrypoints.openai.prom import CONTENT_TYPE, ServerMetrics
from prelude.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerativeScoringRequest,
    RerankRequest,
    RewardRequest,
    ScoreRequest,
    TokenizeRequest,
)
from prelude.entrypoints.openai.routes import ROUTES
from prelude.entrypoints.openai.serving_tokens import detokenize, tokenize
from prelude.entrypoints.openai.streaming import SSEResponse
from prelude.heap import freeze_startup_heap

VERSION = "0.1.0"


def _tokenizer_counters(engine: EngineClient) -> Callable[[], dict[str, float]] | None:
    """fasttoken's safety net, exported as `prelude:tokenizer_fallbacks_total`: encodes
    that HF answered because the fast core failed (absent for tokenizers without one)."""
    tokenizer = engine.tokenizer
    if not hasattr(tokenizer, "fallback_count"):
        return None
    return lambda: {"tokenizer_fallbacks": float(tokenizer.fallback_count)}


def build_app(
    engine: EngineClient,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    metrics_require_key: bool = False,
    trace_stages: bool = False,
    lora_modules: Sequence[tuple[str, str]] = (),
    batch_dir: str | Path | None = None,
    batch_runner: BatchRunnerConfig | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `engine`. With `api_key`, every route but /health
    (and /metrics unless `metrics_require_key`) needs it as a bearer token. With
    `trace_stages`, every request's host time is broken down by stage (GET /debug/stages).
    `lora_modules`: (name, PEFT directory) adapters served from the start (APIError when
    one is bad). With `batch_dir`, /v1/files and /v1/batches keep their files and
    batches there."""
    limits = limits or ServerLimits()
    adapters = ServedAdapters(engine)
    for name, path in lora_modules:
        adapters.load_at_start(name, path)
    app = FastAPI(title="Prelude", version=VERSION)
    app.router.route_class = OffLoopBodyRoute  # large bodies parsed off the event loop
    install_error_handlers(app)
    metrics = ServerMetrics(engine, extra=_tokenizer_counters(engine))
    if hasattr(engine, "set_observer"):
        engine.set_observer(metrics)
    gate = RequestGate(limits.max_waiting_requests)
    app.state.limits, app.state.gate, app.state.metrics = limits, gate, metrics
    app.state.adapters = adapters
    # add_middleware wraps: the last added is outermost. Outer to inner: observe (ids,
    # log line, counts, 401s included), auth, body cap, the app.
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_key:
        open_paths = {"/health"} if metrics_require_key else {"/health", "/metrics"}
        app.add_middleware(BearerAuth, api_key=api_key, open_paths=frozenset(open_paths))
    traces = StageTraces() if trace_stages else None
    app.add_middleware(RequestObserver, count=metrics.count_request, traces=traces)
    if batch_dir is not None:
        # Batch lines go to the engine itself, not through the gate, as low-priority
        # requests: the scheduler runs them behind the interactive ones.
        runner = BatchRunner(engine, BatchStore(batch_dir), limits, config=batch_runner or BatchRunnerConfig(),
                             adapters=adapters)
        install_batch_routes(app, runner)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if gate.draining:
            return error_response("the server is shutting down", 503, code="server_shutting_down")
        if engine.is_healthy():
            # A scale-out client also says how many replicas are live: "degraded" still serves.
            return JSONResponse(engine.health() if hasattr(engine, "health") else {})
        return error_response("the engine loop is not running", 503, code="engine_dead")

    # load balancers' and curl -I's probes (out of the schema: one operation, one id)
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    # An engine in another process is asked first (metrics() and request_metrics() are sync).
    refresh_metrics = getattr(engine, "refresh_metrics", None)
    refresh_request_metrics = getattr(engine, "refresh_request_metrics", None)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if refresh_metrics is not None:
            await refresh_metrics()
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/request_metrics")
    async def request_metrics() -> dict[str, Any]:
        """Recently finished requests' TTFT/TPOT/JCT/SLO records, for benchmarks."""
        if refresh_request_metrics is not None:
            await refresh_request_metrics()
        return {"object": "list", "data": [m._asdict() for m in engine.request_metrics()]}

    @app.get("/debug/integrity")
    async def integrity() -> dict[str, Any]:
        """The KV block pool's integrity check and where every block is (soak tests)."""
        check = getattr(engine, "integrity", None)
        if check is None:
            raise APIError("this engine has no integrity check", 404)
        return await check()

    @app.get("/debug/stages")
    async def stages() -> dict[str, Any]:
        """The stage breakdowns of the traced requests finished since the last call (taken:
        each is returned once). 404 unless the server runs with --trace-stages."""
        if traces is None:
            raise APIError("stage tracing is off: start the server with --trace-stages", 404)
        return {"object": "list", "stages": list(STAGES), "data": traces.take()}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = {"id": engine.model_name, "object": "model", "created": created, "owned_by": "prelude",
                "root": engine.model_name, "parent": None, "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [base, *({
            "id": lora.name, "object": "model", "created": created, "owned_by": "prelude",
            "root": lora.path, "parent": engine.model_name, "max_model_len": engine.max_model_len,
        } for lora in adapters.models())]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        await adapters.load(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        adapters.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    async def _served(url: str, body: Any, request: Request) -> Any:
        """Run one engine-backed handler behind the request gate; a client gone before
        the answer gets no body (and is logged as a cancel, not an error)."""
        mark("http_parse_validate")
        lora = adapters.resolve(body.model)  # 404 for an unknown name
        check_unknown_fields(body, request.scope["path"])  # (request.url would build a URL object)
        ticket = gate.enter()  # 429 / 503 before any work
        record = request_record(request.state)
        gated = GatedEngine(engine, ticket, limits.request_timeout_s, record, lora,
                            adapters.labels(lora) if lora is not None else None)
        try:
            response = await ROUTES[url].handler(body)(gated, body, request)
        except ClientDisconnected:
            ticket.close()
            if record is not None:
                record.cancelled = True
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except BaseException:
            ticket.close()
            raise
        if isinstance(response, SSEResponse):
            def closed(whole: bool) -> None:
                ticket.close()
                if not whole and record is not None:
                    record.cancelled = True  # logged and counted as 499, as a cut non-streamed request

            response.on_close(closed)  # the stream still runs
            return response
        ticket.close()
        return await json_answer(response, request)  # a large answer is serialized off the loop

    # Annotated `-> Response` (they always answer with one): no response model, so a
    # small JSON body skips FastAPI's generic handler (offload.OffLoopBodyRoute).
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _served("/v1/completions", body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _served("/v1/chat/completions", body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await _served("/v1/embeddings", body, request)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest, request: Request) -> Any:
        return await _served("/v1/classify", body, request)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Any:
        return await _served("/v1/score", body, request)

    @app.post("/generative_scoring")
    @app.post("/v1/generative_scoring")
    async def generative_scoring(body: GenerativeScoringRequest, request: Request) -> Any:
        return await _served("/v1/generative_scoring", body, request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Any:
        return await _served("/v1/rerank", body, request)

    @app.post("/reward")
    @app.post("/v1/reward")
    async def reward(body: RewardRequest, request: Request) -> Any:
        return await _served("/v1/reward", body, request)

    @app.post("/v1/decisions")
    async def decisions(body: DecisionRequest, request: Request) -> Any:
        return await _served("/v1/decisions", body, request)

    @app.post("/v1/systemone")
    async def systemone(body: SystemOneRequest, request: Request) -> Any:
        return await _served("/v1/systemone", body, request)

    @app.post("/tokenize", response_model=dict[str, Any])
    async def tokenize_route(body: TokenizeRequest, request: Request) -> Any:
        adapters.resolve(body.model)  # adapters share the base's tokenizer
        check_unknown_fields(body, request.url.path)
        return await json_answer(await off_loop_if_large(request, tokenize, engine, body), request)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        adapters.resolve(body.model)
        check_unknown_fields(body, request.url.path)
        return await off_loop_if_large(request, detokenize, engine, body)

    _engine_routes_first(app)
    return app


def _engine_routes_first(app: FastAPI) -> None:
    """Move the model-running POST routes to the front of the router. Starlette tries the
    routes in order, a regex match each: /v1/completions came after some twenty others
    (docs, files, batches, probes), a cost on every request. No two routes share a path pattern, so
    which one answers a request does not change (a wrong method still finds its 405)."""
    app.router.routes.sort(key=lambda route: getattr(route, "path", None) not in ROUTES)  # stable


def run_server(app: FastAPI, host: str, port: int, engine: Any = None) -> int:
    """Serve `app` until SIGTERM / SIGINT, then drain gracefully (blocking); the exit code."""
    # ws="none": no route is a WebSocket, so uvicorn need not import a WebSocket library at start.
    config = uvicorn.Config(app, host=host, port=port, timeout_keep_alive=30, access_log=False, log_config=None,
                            ws="none")
    server = DrainingServer(config, app.state.gate, app.state.limits.shutdown_timeout_s, engine)
    freeze_startup_heap()  # loaded: what exists now lives as long as the process
    server.run()
    return 0
