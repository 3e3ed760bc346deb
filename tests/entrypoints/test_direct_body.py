"""A small valid JSON body of /v1/completions and /v1/chat/completions goes straight to
the endpoint (offload.OffLoopBodyRoute), skipping FastAPI's generic handler: the answers,
error bodies included, are the ones FastAPI's handler gives for the same request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prelude.entrypoints.openai import offload
from prelude.entrypoints.openai.api_server import build_app

from tests.entrypoints.fake_engine import FakeEngine, asgi_client

pytestmark = pytest.mark.anyio

JSON = {"content-type": "application/json"}
CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("/v1/completions", json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 3}).encode(), JSON),
    ("/v1/completions", json.dumps({"prompt": ["ab", "cd"], "max_tokens": 2, "n": 2, "echo": True}).encode(),
     {"content-type": "application/json; charset=utf-8"}),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "stream": True}).encode(), JSON),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hey"}],
                                         "max_tokens": 3}).encode(), JSON),
    # The errors: each is FastAPI's (or ours, raised inside the endpoint) either way.
    ("/v1/completions", b'{"prompt": ', JSON),  # not JSON
    ("/v1/completions", json.dumps({"prompt": 5}).encode(), JSON),  # an invalid field
    ("/v1/completions", b"[1, 2]", JSON),  # JSON, not an object
    ("/v1/completions", b"\xff\xfe", JSON),  # not text
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}).encode(), {"content-type": "text/plain"}),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}).encode(), {}),  # no content type
    ("/v1/completions", b"", JSON),  # no body
    ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), JSON),  # unknown model: 404
    ("/v1/completions", json.dumps({"prompt": "x", "suffix": "y"}).encode(), JSON),  # refused inside
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), JSON),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _comparable(status: int, headers: Any, text: str) -> tuple[int, str, str]:
    """The answer without what differs between any two requests (ids, timestamps)."""
    kind = headers.get("content-type", "")
    if kind.startswith("application/json"):
        body = json.loads(text)
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in ("id", "created")}
        return status, kind, json.dumps(body, sort_keys=True)
    lines = []
    for line in text.splitlines():  # SSE: each event's JSON without its id and created
        if line.startswith("data: {"):
            event = {k: v for k, v in json.loads(line[6:]).items() if k not in ("id", "created")}
            line = "data: " + json.dumps(event, sort_keys=True)
        lines.append(line)
    return status, kind, "\n".join(lines)


async def _answers(monkeypatch: pytest.MonkeyPatch, direct: bool) -> list[tuple[int, str, str]]:
    if not direct:  # every body declined: FastAPI's handler answers all of them
        monkeypatch.setattr(offload, "_quick_parse", lambda body, model: None)
    taken: list[bool] = []
    parse = offload._quick_parse

    def counted(body: bytes, model: Any) -> Any:
        value = parse(body, model)
        taken.append(value is not None)
        return value

    monkeypatch.setattr(offload, "_quick_parse", counted)
    out = []
    async with asgi_client(build_app(FakeEngine())) as client:
        for path, body, headers in CASES:
            r = await client.post(path, content=body, headers=headers)
            out.append(_comparable(r.status_code, r.headers, r.text))
    if direct:  # parsed: the JSON-typed non-empty bodies; direct: the valid ones (3 refused inside)
        assert taken == [True] * 4 + [False] * 4 + [True] * 3
    else:
        assert not any(taken)
    monkeypatch.undo()
    return out


async def test_direct_answers_are_fastapis(monkeypatch: pytest.MonkeyPatch) -> None:
    direct = await _answers(monkeypatch, direct=True)
    through_fastapi = await _answers(monkeypatch, direct=False)
    assert [status for status, _, _ in direct] == [200] * 4 + [400] * 7 + [404, 400, 400]
    assert direct == through_fastapi


def test_only_endpoints_that_take_the_body_and_request_and_answer_a_response_go_direct() -> None:
    app = build_app(FakeEngine())
    direct = {route.path for route in app.router.routes
              if isinstance(route, offload.OffLoopBodyRoute) and offload._direct_params(route) is not None}
    assert direct == {"/v1/completions", "/v1/chat/completions"}  # the others answer dicts FastAPI encodes
