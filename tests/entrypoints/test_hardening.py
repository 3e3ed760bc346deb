"""The server's hardening over the fake engine: auth on every route (walked from the route
table), 429 past --max-waiting-requests, limits (413 / 400), the request timeout, the
drain's 503, refused answer-changing fields, request ids, the per-request log line and
the Prometheus exposition."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from fastapi.routing import APIRoute
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Route

from prelude.entrypoints.openai.api_server import build_app
from prelude.entrypoints.openai.limits import ServerLimits
from prelude.log_format import JsonFormatter

from tests.entrypoints.fake_engine import FakeEngine, asgi_client
from tests.entrypoints.test_openai_server import assert_error

pytestmark = pytest.mark.anyio
OPEN = {"/health", "/metrics"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _routes(app: Any) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        if isinstance(route, (APIRoute, Route)):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    out.append((method, route.path))
    return out


@pytest.mark.parametrize("metrics_require_key", [False, True])
async def test_every_route_but_health_needs_the_key(metrics_require_key: bool) -> None:
    """Walks the route table, so a route added later can not forget the key."""
    app = build_app(FakeEngine(), api_key="s3cret", metrics_require_key=metrics_require_key)
    routes = _routes(app)
    assert ("POST", "/classify") in routes and ("GET", "/v1/request_metrics") in routes
    open_paths = {"/health"} if metrics_require_key else OPEN
    async with asgi_client(app) as c:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = await c.request(method, path, headers=headers, json={})
                if path in open_paths:
                    assert r.status_code == 200, (method, path)
                else:
                    assert_error(r, 401, "authentication_error")
                    assert r.headers["www-authenticate"] == "Bearer"
            r = await c.request(method, path, headers={"Authorization": "Bearer s3cret"}, json={})
            assert r.status_code != 401, (method, path)
        assert_error(await c.get("/not/a/route"), 401, "authentication_error")  # default deny


async def test_overload_answers_429_and_leaves_the_let_through_alone() -> None:
    engine = FakeEngine()
    engine.first_token = asyncio.Event()  # both admitted requests wait to start until released
    app = build_app(engine, limits=ServerLimits(max_waiting_requests=2))
    body = {"prompt": "slow", "max_tokens": 3}
    async with asgi_client(app) as c:
        admitted = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
        for _ in range(6000):  # a condition, not a delay: both are in, waiting for their first token
            if app.state.gate.waiting == 2:
                break
            await asyncio.sleep(0.005)
        assert app.state.gate.waiting == 2
        r = await asyncio.wait_for(c.post("/v1/completions", json=body), 30)  # admitted, it would hang
        err = assert_error(r, 429, "rate_limit_error")
        assert r.headers["retry-after"] == "1" and err["code"] == "rate_limit_exceeded"
        assert_error(await c.post("/v1/embeddings", json={"input": "x"}), 429, "rate_limit_error")
        engine.first_token.set()
        done = await asyncio.gather(*admitted)
        assert [d.status_code for d in done] == [200, 200]
        assert all(d.json()["choices"][0]["finish_reason"] == "length" for d in done)
        assert app.state.gate.waiting == 0 and app.state.gate.active == 0
        assert (await c.post("/v1/completions", json=body)).status_code == 200  # room again
    assert engine.running() == []


async def test_streams_count_as_waiting_only_until_their_first_output() -> None:
    engine = FakeEngine(token_delay=0.02)
    app = build_app(engine, limits=ServerLimits(max_waiting_requests=1))
    async with asgi_client(app) as c:
        first = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stream": True})
        assert first.status_code == 200
        assert app.state.gate.waiting == 0 and app.state.gate.active == 0  # released when the stream ended


async def test_body_size_and_batch_and_token_limits() -> None:
    limits = ServerLimits(max_body_bytes=2000, max_batch_inputs=3, max_request_tokens=40)
    async with asgi_client(build_app(FakeEngine(), limits=limits)) as c:
        big = {"prompt": "x" * 3000}
        r = await c.post("/v1/completions", json=big)
        assert_error(r, 413)
        async def no_length() -> Any:  # chunked: no Content-Length to refuse it by
            yield json.dumps(big).encode()

        chunked = await c.post("/v1/completions", content=no_length(), headers={"content-type": "application/json"})
        assert_error(chunked, 413)
        err = assert_error(await c.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1}))
        assert err["param"] == "prompt" and err["code"] == "too_many_inputs"
        err = assert_error(await c.post("/v1/embeddings", json={"input": ["a", "b", "c", "d"]}))
        assert err["code"] == "too_many_inputs"
        err = assert_error(await c.post("/v1/rerank", json={"query": "q", "documents": ["a"] * 4}))
        assert err["param"] == "documents"
        # generative scoring packs its items into few rows: the items count, not the rows
        for path in ("/v1/generative_scoring", "/v1/score"):
            err = assert_error(await c.post(path, json={"query": "q", "items": ["a"] * 4, "label_token_ids": [1]}))
            assert err["param"] == "items" and err["code"] == "too_many_inputs", path
        # prompt tokens x n: 11 tokens (BOS + 10) x n = 4 is over 40
        err = assert_error(await c.post("/v1/completions", json={"prompt": "y" * 10, "n": 4, "max_tokens": 1}))
        assert err["code"] == "request_too_large"
        ok = await c.post("/v1/completions", json={"prompt": "y" * 10, "n": 3, "max_tokens": 1})
        assert ok.status_code == 200


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70])
async def test_seed_outside_the_generator_range_is_a_400(seed: int) -> None:
    async with asgi_client(build_app(FakeEngine())) as c:
        err = assert_error(await c.post("/v1/completions", json={"prompt": "a", "seed": seed}))
        assert err["param"] == "seed"


async def test_largest_seed_with_n_choices_is_served() -> None:
    async with asgi_client(build_app(FakeEngine())) as c:
        r = await c.post("/v1/completions", json={"prompt": "ab", "seed": 2**64 - 1, "n": 3, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3


async def test_request_timeout_aborts() -> None:
    engine = FakeEngine(token_delay=0.05)
    async with asgi_client(build_app(engine, limits=ServerLimits(request_timeout_s=0.12))) as c:
        r = await c.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 50, "ignore_eos": True})
        err = assert_error(r, 408, "timeout_error")
        assert err["code"] == "request_timeout"
        stream = await c.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 50, "ignore_eos": True,
                                                       "stream": True})
        assert stream.status_code == 200 and '"code": "request_timeout"' in stream.text
        assert stream.text.endswith("data: [DONE]\n\n")
    assert engine.running() == [] and set(engine.states().values()) == {"closed"}


async def test_draining_refuses_new_requests_with_503() -> None:
    app = build_app(FakeEngine())
    app.state.gate.draining = True
    async with asgi_client(app) as c:
        err = assert_error(await c.post("/v1/completions", json={"prompt": "a"}), 503, "service_unavailable_error")
        assert err["code"] == "server_shutting_down"
        assert (await c.get("/health")).status_code == 503  # load balancers stop sending
        assert (await c.get("/v1/models")).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("logit_bias", {"5": 100}),
    ("best_of", 3),
    ("best_of", True),  # JSON true is no off value, though Python takes it for 1
    ("min_tokens", True),
])
async def test_answer_changing_fields_are_refused(field: str, value: Any) -> None:
    engine = FakeEngine()
    async with asgi_client(build_app(engine)) as c:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            err = assert_error(await c.post(path, json={**body, field: value}))
            assert err["param"] == field and field in err["message"]
    assert engine.calls == {}  # nothing ran


async def test_off_values_and_unknown_fields_are_accepted_with_one_warning(caplog: Any) -> None:
    async with asgi_client(build_app(FakeEngine())) as c:
        with caplog.at_level(logging.WARNING, logger="prelude.server"):
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": {},
                "best_of": 1, "length_penalty": 1.0, "min_tokens": 0,
                "metadata": {"a": "b"}, "store": False})
    assert r.status_code == 200
    warnings = [rec.getMessage() for rec in caplog.records if "unknown fields" in rec.getMessage()]
    assert warnings == ["/v1/chat/completions: ignoring unknown fields metadata, store"]


async def test_request_id_is_echoed_or_generated_and_logged(caplog: Any) -> None:
    async with asgi_client(build_app(FakeEngine())) as c:
        with caplog.at_level(logging.INFO, logger="prelude.access"):
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2},
                             headers={"X-Request-Id": "client-id-1"})
            s = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stream": True})
            bad = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": -1})
    assert r.headers["x-request-id"] == "client-id-1"
    assert len(s.headers["x-request-id"]) == 32 and bad.headers["x-request-id"]
    records = [rec for rec in caplog.records if rec.name == "prelude.access"]
    fields = [rec.request for rec in records]  # type: ignore[attr-defined]
    assert [f["status"] for f in fields] == [200, 200, 400]
    first = fields[0]
    assert first["request_id"] == "client-id-1" and first["route"] == "/v1/completions"
    assert first["exec_class"] == "paged" and first["prompt_tokens"] == 4 and first["output_tokens"] == 2
    assert first["ttft_ms"] is not None and first["duration_ms"] >= first["ttft_ms"]
    assert fields[1]["output_tokens"] == 2  # the stream's line is written when it ended
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["request_id"] == "client-id-1" and line["level"] == "info" and line["status"] == 200



async def test_logged_class_is_the_one_validation_picked(caplog: Any) -> None:
    """max_tokens=1 is OneShot, unless the engine sends everything down the Paged path."""
    classes = []
    for force_paged in (False, True):
        engine = FakeEngine()
        engine.force_paged = force_paged
        async with asgi_client(build_app(engine)) as c:
            with caplog.at_level(logging.INFO, logger="prelude.access"):
                caplog.clear()
                r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1})
        assert r.status_code == 200
        classes.append([rec.request["exec_class"] for rec in caplog.records if rec.name == "prelude.access"])
    assert classes == [["oneshot"], ["paged"]]


async def test_prometheus_exposition_with_vllm_names() -> None:
    async with asgi_client(build_app(FakeEngine())) as c:
        await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1})
        await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": -1})
        r = await c.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("prelude:num_requests_running", "prelude:num_requests_waiting", "prelude:kv_cache_usage_perc",
                 "prelude:time_to_first_token_seconds", "prelude:time_per_output_token_seconds",
                 "prelude:e2e_request_latency_seconds", "prelude:request_queue_time_seconds",
                 "prelude:prompt_tokens", "prelude:generation_tokens", "prelude:prefix_cache_queries",
                 "prelude:prefix_cache_hits", "prelude:step_duration_seconds", "prelude:kv_blocks"):
        assert name in families, name
    assert {s.labels["exec_class"] for s in families["prelude:num_requests_running"].samples} == {"paged", "oneshot"}
    requests = {(s.labels["route"], s.labels["status"], s.labels["exec_class"]): s.value
                for s in families["prelude:http_requests"].samples if s.name.endswith("_total")}
    assert requests[("/v1/completions", "200", "oneshot")] == 1
    assert requests[("/v1/completions", "400", "none")] == 1


async def test_tokenizer_fallback_counter_is_exported() -> None:
    engine = FakeEngine()
    engine.tokenizer.fallback_count = 3  # type: ignore[attr-defined]  # fasttoken's accessor
    async with asgi_client(build_app(engine)) as c:
        text = (await c.get("/metrics")).text
    assert 'prelude:tokenizer_fallbacks_total{model_name="fake-model"} 3.0' in text


@pytest.mark.parametrize("path,body,param,forms", [
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt", ("str", "list[int]")),
    ("/v1/embeddings", {"input": 3.5}, "input", ("str",)),
])
async def test_a_field_of_several_forms_names_the_field_and_its_forms(
        path: str, body: dict[str, Any], param: str, forms: tuple[str, ...]) -> None:
    """pydantic reports one error per accepted form of a union field, each located at the
    form's type (prompt.str): the answer names the field and the forms instead."""
    async with asgi_client(build_app(FakeEngine())) as c:
        err = assert_error(await c.post(path, json=body))
    assert err["param"] == param and err["message"].startswith(f"{param}: matches none of the accepted forms (")
    assert all(form in err["message"] for form in forms), err["message"]
