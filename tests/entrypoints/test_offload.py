"""Large bodies are parsed and validated, and large answers serialized, off the event loop:
a stream keeps flowing meanwhile, and the answers (errors included) are the ones the
inline path gives."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, Callable

import pytest

from prelude.entrypoints.openai import offload
from prelude.entrypoints.openai.api_server import build_app
from prelude.entrypoints.openai.limits import ServerLimits

from tests.entrypoints.fake_engine import FakeEngine, asgi_client

pytestmark = pytest.mark.anyio

SMALL = ServerLimits(offload_bytes=1024, offload_values=1000)  # everything below is "large"
NEVER = ServerLimits(offload_bytes=2**40, offload_values=2**40)  # the inline path


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def asgi_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """An HTTP POST scope for driving the app through raw ASGI."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 1), "server": ("test", 80)}


async def _stream_counting(app: Any, body: dict[str, Any], chunks: list[int]) -> None:
    """One streamed completion driven through raw ASGI (httpx's ASGI transport buffers
    whole answers), counting body chunks as the app sends them."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks[0] += 1

    await app(asgi_scope("/v1/completions", [(b"content-type", b"application/json")]), receive, send)


def _waits_for_chunks(real: Callable[..., Any], chunks: list[int], seen: list[int]) -> Callable[..., Any]:
    """`real`, made slow deterministically: it blocks its thread until the stream has sent
    5 more chunks (or 10 s pass). On the event loop it would block the stream itself, and
    see none."""

    def slow(*args: Any) -> Any:
        at_start, deadline = chunks[0], time.monotonic() + 10
        while chunks[0] - at_start < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append(chunks[0] - at_start)
        return real(*args)

    return slow


@pytest.mark.parametrize("work", ["parse_body", "render_json"])
async def test_a_stream_keeps_flowing_while_a_large_body_is_parsed_or_an_answer_serialized(
        monkeypatch: pytest.MonkeyPatch, work: str) -> None:
    engine = FakeEngine(max_model_len=8192, token_delay=0.002)
    app = build_app(engine, limits=SMALL)
    chunks, seen = [0], []
    monkeypatch.setattr(offload, work, _waits_for_chunks(getattr(offload, work), chunks, seen))
    stream = asyncio.ensure_future(_stream_counting(
        app, {"prompt": "abc" * 20, "max_tokens": 4000, "ignore_eos": True, "stream": True}, chunks))
    while chunks[0] < 3:  # the stream is flowing
        await asyncio.sleep(0.005)
    # A 1,500-character prompt: a 1.5 KB body (> 1 KiB) and 1,500 token ids (> 1,000 values).
    async with asgi_client(app) as c:
        r = await c.post("/tokenize", json={"prompt": "x" * 1500, "add_special_tokens": False})
    stream.cancel()
    await asyncio.gather(stream, return_exceptions=True)
    assert r.status_code == 200 and r.json()["count"] == 1500
    assert r.json()["tokens"] == [ord("x") + 16] * 1500
    assert seen and seen[0] >= 5, f"the stream sent {seen} chunks while {work} ran"


_PAD = "p" * 2000  # makes any body below "large" for SMALL


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", b'{"prompt": "x", "user": "' + _PAD.encode() + b'", '),  # truncated JSON
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -3, "user": _PAD}).encode()),
    ("/v1/completions", json.dumps({"prompt": 12, "user": _PAD}).encode()),
    ("/v1/completions", b'{"prompt": "x\\ud800", "user": "' + _PAD.encode() + b'"}'),  # lone surrogate
    ("/v1/completions", json.dumps([_PAD]).encode()),  # not an object
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "nobody", "content": _PAD}]}).encode()),
    ("/tokenize", json.dumps({"prompt": _PAD, "messages": [{"role": "user", "content": "x"}]}).encode()),
    ("/v1/completions", json.dumps({"prompt": [1, 2, "x"] * 400}).encode()),
])
async def test_a_large_bad_body_gets_the_400_the_inline_path_gives(path: str, raw: bytes) -> None:
    answers = []
    for limits in (SMALL, NEVER):
        async with asgi_client(build_app(FakeEngine(), limits=limits)) as c:
            answers.append(await c.post(path, content=raw, headers={"content-type": "application/json"}))
    off, inline = answers
    assert off.status_code == inline.status_code and 400 <= off.status_code < 500, (off.text, inline.text)
    assert off.json() == inline.json()
    assert set(off.json()["error"]) == {"message", "type", "param", "code"}


async def test_a_large_good_body_is_served_as_the_inline_path_serves_it() -> None:
    body = {"prompt": "hello " * 400, "max_tokens": 5, "temperature": 0, "logprobs": 2, "user": _PAD,
            "echo": True}
    answers = []
    for limits in (SMALL, NEVER):
        async with asgi_client(build_app(FakeEngine(max_model_len=8192), limits=limits)) as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            answers.append(r.json())
    for a in answers:
        a.pop("id"), a.pop("created")
    assert answers[0] == answers[1]


def test_render_json_matches_json_and_writes_non_finite_as_null() -> None:
    value = {"a": list(range(5000)), "b": [{"x": [1.5, -2.0], "y": None, "z": "é\"\n"}] * 3, "c": True,
             "d": [[1, 2], [3]], "e": (1, "two"), "f": {}, "g": []}
    assert json.loads(offload.render_json(value)) == json.loads(json.dumps(value))
    assert json.loads(offload.render_json({"v": [1.0, math.nan, math.inf]})) == {"v": [1.0, None, None]}


def test_holds_many_values_stops_at_its_budget() -> None:
    assert not offload.holds_many_values({"a": [1] * 10, "b": {"c": [2] * 10}}, budget=30)
    assert offload.holds_many_values({"a": [1] * 10, "b": {"c": [2] * 30}}, budget=30)
    assert offload.holds_many_values([[0] * 10] * 10, budget=50)
    assert not offload.holds_many_values("x" * 10**6, budget=1)


async def test_a_client_gone_before_its_body_arrived_is_logged_as_a_cancel(caplog: pytest.LogCaptureFixture) -> None:
    app = build_app(FakeEngine())
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = asgi_scope("/v1/completions", [(b"content-type", b"application/json"), (b"content-length", b"99")])
    with caplog.at_level("INFO"):
        await app(scope, receive, send)
    assert statuses == [499]
    assert not [r for r in caplog.records if "unhandled" in r.getMessage()]
    assert [r for r in caplog.records if r.name == "prelude.access" and r.getMessage().startswith("cancelled")]
