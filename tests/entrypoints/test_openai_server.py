"""The OpenAI-compatible server over a model-free FakeEngine: response shapes, SSE
streaming, n > 1 fan-out, logprobs, bad input -> 400 with an OpenAI error body,
unexpected errors -> 500, auth, and client disconnects that must end engine work.

In-process tests go through httpx's ASGI transport; the openai client and the
disconnect tests use a real uvicorn server on a loopback port.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Callable, Iterator

import httpx
import openai
import pytest

from prelude.engine.request import SamplingParams
from prelude.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import running_server
from tests.entrypoints.fake_engine import (
    BOS,
    FAIL_ADMISSION,
    FAIL_ENGINE,
    TEMPLATE_ERROR,
    FakeEngine,
    char_token,
)

pytestmark = pytest.mark.anyio

USER_HI = [{"role": "user", "content": "hi"}]
CHAT_PROMPT_HI = "<|user|>hi<|end|><|assistant|>"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    # raise_app_exceptions=False: Starlette re-raises after sending a 500 (for server logs).
    transport = httpx.ASGITransport(app=build_app(engine), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c
    assert engine.running() == [], "a request was left running"


def chars(text: str) -> list[int]:
    return [char_token(c) for c in text]


def sse_events(body: str) -> list[Any]:
    """Parsed `data:` payloads of an SSE body; [DONE] stays a string. Checks the framing."""
    assert body.endswith("data: [DONE]\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1
    return events[:-1]


def assert_error(r: httpx.Response, status: int = 400, kind: str = "invalid_request_error") -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == kind
    return err


def only_params(engine: FakeEngine) -> SamplingParams:
    (call,) = engine.calls.values()
    return call.params


# --- completions ---------------------------------------------------------------------


async def test_completion_shape_and_usage(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "hello", "max_tokens": 3})
    body = r.json()
    assert r.status_code == 200 and body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion" and body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "oll", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}  # BOS + 5 chars
    (rid,) = engine.calls
    assert rid == body["id"] + "-0" and engine.calls[rid].prompt_token_ids == [BOS, *chars("hello")]


async def test_completion_defaults_follow_openai(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hello"})  # no model: the served one
    assert r.json()["choices"][0] | {"text": None} == {"index": 0, "text": None, "logprobs": None,
                                                      "finish_reason": "stop", "stop_reason": None}
    assert r.json()["choices"][0]["text"] == "olleh"  # EOS after one pass: finish "stop"
    assert r.json()["usage"]["completion_tokens"] == 6  # the EOS token counts
    p = only_params(engine)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n, p.seed, p.stop, p.logprobs) == (
        16, 1.0, 1.0, -1, 1, None, (), None)


async def test_sampling_fields_reach_the_engine(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={
        "prompt": "hello", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "stop": ["zz", "yy"], "stop_token_ids": [7], "ignore_eos": True, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "user": "someone", "an_unknown_field": {"is": "ignored"},
    })
    assert r.status_code == 200, r.text
    assert only_params(engine) == SamplingParams(
        max_tokens=4, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, stop=("zz", "yy"), stop_token_ids=(7,), ignore_eos=True,
        skip_special_tokens=False, include_stop_str_in_output=True,
    )


PROMPT_FORMS = ["ab", ["ab", "xyz"], [BOS, *chars("ab")], [[BOS, *chars("ab")], [BOS, *chars("xyz")]]]


@pytest.mark.parametrize("prompt", PROMPT_FORMS, ids=["str", "list of str", "token ids", "list of token ids"])
async def test_prompt_forms_and_choice_indexes(client: httpx.AsyncClient, engine: FakeEngine, prompt: Any) -> None:
    r = await client.post("/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 2, "ignore_eos": True})
    body = r.json()
    two = isinstance(prompt, list) and isinstance(prompt[0], (str, list))
    expected = ["ba", "ba", "zy", "zy"] if two else ["ba", "ba"]
    assert [c["index"] for c in body["choices"]] == list(range(len(expected)))  # prompt_idx * n + i
    assert [c["text"] for c in body["choices"]] == expected
    prompt_tokens = 3 + 4 if two else 3  # once per prompt, not per choice
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 2 * len(expected),
                             "total_tokens": prompt_tokens + 2 * len(expected)}
    assert sorted(engine.calls) == [f"{body['id']}-{i}" for i in range(len(expected))]


async def test_n_seeded_choices_differ_and_repeat(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    req = {"prompt": "abcd", "n": 3, "seed": 10, "max_tokens": 4, "ignore_eos": True}
    first = (await client.post("/v1/completions", json=req)).json()
    second = (await client.post("/v1/completions", json=req)).json()
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts)) == 3 and texts == [c["text"] for c in second["choices"]]
    seeds = {rid: c.params.seed for rid, c in engine.calls.items() if rid.startswith(first["id"])}
    assert seeds == {f"{first['id']}-{i}": 10 + i for i in range(3)}
    assert all(c.params.n == 1 for c in engine.calls.values())


@pytest.mark.parametrize("extra,text,reason,stop_reason", [
    ({"stop": "l"}, "o", "stop", "l"),
    ({"stop": ["q", "le"]}, "ol", "stop", "le"),
    ({"stop": "l", "include_stop_str_in_output": True}, "ol", "stop", "l"),
    ({"stop_token_ids": [char_token("e")]}, "oll", "stop", char_token("e")),
])
async def test_stop_reasons_pass_through(client: httpx.AsyncClient, extra: dict[str, Any], text: str, reason: str,
                                         stop_reason: Any) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 10, **extra})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (text, reason, stop_reason)


async def test_echo_prepends_the_prompt(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hi", "echo": True, "max_tokens": 2, "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == "hiih"
    r = await client.post("/v1/completions", json={"prompt": [BOS, *chars("hi")], "echo": True, "max_tokens": 0})
    assert r.json()["choices"][0]["text"] == "<s>hi" and r.json()["usage"]["completion_tokens"] == 0


async def test_legacy_logprobs_shape(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["o", "l", "l"]
    assert lp["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert lp["text_offset"] == [0, 1, 2]
    assert [len(top) for top in lp["top_logprobs"]] == [2, 2, 2]
    assert lp["top_logprobs"][0] == pytest.approx({"o": -0.1, "p": -1.1})


async def test_legacy_logprobs_zero_gives_the_sampled_token_alone(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


async def test_echo_with_logprobs_includes_prompt_logprobs(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    # lm-eval's loglikelihood request; the engine computes prompt logprobs (k = logprobs).
    r = await client.post("/v1/completions", json={"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 1,
                                                   "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<s>", "h", "i", "i"]
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:3] == [-0.5, -0.5]
    assert only_params(engine).prompt_logprobs == 1


# --- chat ------------------------------------------------------------------------------


async def test_chat_shape_and_rendering(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    r = await client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages, "max_tokens": 3})
    body = r.json()
    rendered = "<|system|>S<|end|>" + CHAT_PROMPT_HI
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": ">|t"}, "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": len(rendered), "completion_tokens": 3, "total_tokens": len(rendered) + 3}
    (call,) = engine.calls.values()
    assert call.prompt_token_ids == chars(rendered)  # encoded without a BOS of its own


async def test_chat_request_fields(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": "Sure"}, {"role": "tool", "content": "42", "tool_call_id": "t1"}]
    r = await client.post("/v1/chat/completions", json={
        "messages": parts, "max_tokens": 50, "max_completion_tokens": 2, "add_generation_prompt": False,
        "chat_template_kwargs": {"upper": True},
    })
    assert r.status_code == 200, r.text
    (call,) = engine.calls.values()
    assert call.params.max_tokens == 2  # max_completion_tokens wins
    assert call.prompt_token_ids == chars("<|user|>A\nB<|end|><|assistant|>SURE<|end|><|tool|>42<|end|>")
    assert engine.tokenizer.last_template_kwargs == {"upper": True}


async def test_chat_continue_final_message(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    messages = [*USER_HI, {"role": "assistant", "content": "Once upon"}]
    r = await client.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True,
                                                        "max_tokens": 2, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    (call,) = engine.calls.values()
    assert call.prompt_token_ids == chars("<|user|>hi<|end|><|assistant|>Once upon")
    assert r.json()["choices"][0]["message"]["content"] == "no"


async def test_chat_logprobs_shape(client: httpx.AsyncClient) -> None:
    messages = [*USER_HI, {"role": "assistant", "content": "é"}]  # output starts with é: two UTF-8 bytes
    r = await client.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True,
                                                        "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["é", ">"]
    first = content[0]
    assert first["logprob"] == pytest.approx(-0.1) and first["bytes"] == [195, 169]
    assert [t["token"] for t in first["top_logprobs"]] == ["é", "ê"]
    assert all(set(t) == {"token", "logprob", "bytes"} for t in first["top_logprobs"])
    plain = await client.post("/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 1, "logprobs": True})
    assert plain.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


# --- streaming ------------------------------------------------------------------------------


async def test_completion_stream_matches_the_full_answer(client: httpx.AsyncClient) -> None:
    req = {"prompt": "hello", "max_tokens": 4}
    full = (await client.post("/v1/completions", json=req)).json()
    r = await client.post("/v1/completions", json={**req, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r.text)
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


async def test_completion_stream_echo_and_logprobs(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True, "echo": True,
                                                   "ignore_eos": True})
    assert [c["choices"][0]["text"] for c in sse_events(r.text)] == ["hii", "h"]
    r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": True, "logprobs": 1})
    lps = [c["choices"][0]["logprobs"] for c in sse_events(r.text)]
    assert [lp["tokens"] for lp in lps] == [["o"], ["l"], ["l"]]
    assert [lp["text_offset"] for lp in lps] == [[0], [1], [2]]  # offsets run on across chunks


@pytest.mark.parametrize("path,req", [
    ("/v1/completions", {"prompt": "hello"}), ("/v1/chat/completions", {"messages": USER_HI})])
async def test_stream_include_usage(client: httpx.AsyncClient, path: str, req: dict[str, Any]) -> None:
    r = await client.post(path, json={**req, "max_tokens": 3, "stream": True,
                                      "stream_options": {"include_usage": True}})
    chunks = sse_events(r.text)
    *content, last = chunks
    assert all(c["usage"] is None and c["choices"] for c in content)  # OpenAI: null until the end
    prompt_tokens = 6 if path == "/v1/completions" else len(CHAT_PROMPT_HI)
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                                       "total_tokens": prompt_tokens + 3}
    r = await client.post(path, json={**req, "max_tokens": 3, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    running = [c["usage"]["completion_tokens"] for c in sse_events(r.text)]
    assert running == sorted(running) and running[-1] == 3


async def test_chat_stream_shape(client: httpx.AsyncClient) -> None:
    full = (await client.post("/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 3})).json()
    r = await client.post("/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 3, "stream": True})
    chunks = sse_events(r.text)
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(ch["finish_reason"] is None and set(ch["delta"]) == {"content"} for ch in choices[1:-1])
    assert "".join(ch["delta"]["content"] for ch in choices[1:-1]) == full["choices"][0]["message"]["content"]
    assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("path,req", [
    ("/v1/completions", {"prompt": "abcdef"}), ("/v1/chat/completions", {"messages": USER_HI})])
async def test_n2_streams_are_merged_as_they_arrive(client: httpx.AsyncClient, engine: FakeEngine, path: str,
                                                    req: dict[str, Any]) -> None:
    engine.token_delay = 0.005
    body = {**req, "n": 2, "seed": 1, "max_tokens": 5, "ignore_eos": True}
    full = (await client.post(path, json=body)).json()
    chunks = sse_events((await client.post(path, json={**body, "stream": True})).text)
    order = [c["choices"][0]["index"] for c in chunks]
    assert order != sorted(order), "choices should interleave, not run one after the other"
    for ch in full["choices"]:
        deltas = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == ch["index"]]
        if path == "/v1/completions":
            assert "".join(d["text"] for d in deltas) == ch["text"]
        else:
            assert "".join(d["delta"].get("content", "") for d in deltas) == ch["message"]["content"]
        assert deltas[-1]["finish_reason"] == "length"


# --- other routes ---------------------------------------------------------------------


async def test_models_health_version(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    (model,) = (await client.get("/v1/models")).json()["data"]
    assert (model["id"], model["object"], model["owned_by"], model["max_model_len"]) == (
        "fake-model", "model", "prelude", 256)
    health = await client.get("/health")
    assert (health.status_code, health.json()) == (200, {})
    engine.healthy = False
    assert_error(await client.get("/health"), 503, "service_unavailable_error")
    assert (await client.get("/version")).json()["version"]


async def test_tokenize_and_detokenize(client: httpx.AsyncClient) -> None:
    r = (await client.post("/tokenize", json={"prompt": "hi"})).json()
    assert r == {"count": 3, "max_model_len": 256, "tokens": [BOS, *chars("hi")]}
    r = (await client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})).json()
    assert r["tokens"] == chars("hi")
    r = (await client.post("/tokenize", json={"messages": USER_HI})).json()
    assert r["tokens"] == chars(CHAT_PROMPT_HI)  # exactly what /v1/chat/completions would run
    r = await client.post("/detokenize", json={"tokens": [BOS, *chars("hi")]})
    assert r.json() == {"prompt": "<s>hi"}


async def test_api_key_guards_v1_routes(engine: FakeEngine) -> None:
    transport = httpx.ASGITransport(app=build_app(engine, api_key="sekret"))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        assert_error(await c.get("/v1/models"), 401, "authentication_error")
        assert_error(await c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "authentication_error")
        assert (await c.get("/health")).status_code == 200
        auth = {"Authorization": "Bearer sekret"}
        assert (await c.get("/v1/models", headers=auth)).status_code == 200
        r = await c.post("/v1/completions", headers=auth, json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert "".join(ch["choices"][0]["text"] for ch in sse_events(r.text)) == "ih"


# --- errors ----------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_REQUESTS: list[tuple[str, str, Any]] = [
    ("malformed json", COMPLETIONS, "{not json"),
    ("body not an object", COMPLETIONS, "[1, 2]"),
    ("missing prompt", COMPLETIONS, {"max_tokens": 3}),
    ("negative max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": -1}),
    ("negative temperature", COMPLETIONS, {"prompt": "x", "temperature": -0.1}),
    ("temperature above 2", COMPLETIONS, {"prompt": "x", "temperature": 2.5}),
    ("top_p zero", COMPLETIONS, {"prompt": "x", "top_p": 0}),
    ("top_p above one", COMPLETIONS, {"prompt": "x", "top_p": 1.5}),
    ("n zero", COMPLETIONS, {"prompt": "x", "n": 0}),
    ("logprobs above 20", COMPLETIONS, {"prompt": "x", "logprobs": 21}),
    ("negative logprobs", COMPLETIONS, {"prompt": "x", "logprobs": -1}),
    ("empty prompt list", COMPLETIONS, {"prompt": []}),
    ("empty token prompt", COMPLETIONS, {"prompt": [[]]}),
    ("wrong type max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": "many"}),
    ("wrong type stop", COMPLETIONS, {"prompt": "x", "stop": 5}),
    ("wrong type prompt", COMPLETIONS, {"prompt": {"a": 1}}),
    ("mixed prompt list", COMPLETIONS, {"prompt": [1, "a"]}),
    ("suffix", COMPLETIONS, {"prompt": "x", "suffix": "y"}),
    ("empty suffix", COMPLETIONS, {"prompt": "x", "suffix": ""}),
    ("stream_options without stream", COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}),
    ("presence_penalty out of range", COMPLETIONS, {"prompt": "x", "presence_penalty": 3}),
    ("top_k invalid", COMPLETIONS, {"prompt": "x", "top_k": -5}),
    ("empty stop string", COMPLETIONS, {"prompt": "x", "stop": [""]}),
    ("prompt too long", COMPLETIONS, {"prompt": "y" * 300}),
    ("prompt plus max_tokens over context", COMPLETIONS, {"prompt": "y" * 200, "max_tokens": 100}),
    ("out of vocabulary token", COMPLETIONS, {"prompt": [1, -5]}),
    ("admission refused by generate", COMPLETIONS, {"prompt": FAIL_ADMISSION}),
    ("empty messages", CHAT, {"messages": []}),
    ("missing messages", CHAT, {"max_tokens": 2}),
    ("messages not a list", CHAT, {"messages": "hi"}),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}),
    ("top_logprobs without logprobs", CHAT, {"messages": USER_HI, "top_logprobs": 2}),
    ("top_logprobs above 20", CHAT, {"messages": USER_HI, "logprobs": True, "top_logprobs": 21}),
    ("negative max_completion_tokens", CHAT, {"messages": USER_HI, "max_completion_tokens": -1}),
    ("temperature above 2 (chat)", CHAT, {"messages": USER_HI, "temperature": 3}),
    ("continue a user message", CHAT, {"messages": USER_HI, "continue_final_message": True}),
    ("template error", CHAT, {"messages": [{"role": "user", "content": TEMPLATE_ERROR}]}),
    ("tokenize nothing", "/tokenize", {}),
    ("tokenize both", "/tokenize", {"prompt": "x", "messages": USER_HI}),
    ("detokenize out of vocabulary", "/detokenize", {"tokens": [-1]}),
]


@pytest.mark.parametrize("name,path,body", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
async def test_bad_input_is_400_and_the_server_keeps_serving(client: httpx.AsyncClient, name: str, path: str,
                                                             body: Any) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    assert_error(await client.post(path, content=content, headers={"Content-Type": "application/json"}))
    ok = await client.post(COMPLETIONS, json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ko"


@pytest.mark.parametrize("path,req", [(COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": USER_HI}),
                                      ("/tokenize", {"prompt": "x"})])
async def test_unknown_model_is_404_model_not_found(client: httpx.AsyncClient, path: str, req: dict[str, Any]) -> None:
    err = assert_error(await client.post(path, json={**req, "model": "gpt-9"}), 404, "not_found_error")
    assert err["code"] == "model_not_found" and "does not exist" in err["message"] and err["param"] == "model"


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing-here"), 404, "not_found_error")
    assert_error(await client.get(COMPLETIONS), 405)


async def test_unexpected_engine_error_is_500_and_the_server_keeps_serving(client: httpx.AsyncClient,
                                                                           engine: FakeEngine) -> None:
    r = await client.post(COMPLETIONS, json={"prompt": FAIL_ENGINE, "n": 2, "max_tokens": 5})
    err = assert_error(r, 500, "server_error")
    assert "engine exploded" in err["message"]
    assert sorted(engine.states().values()) in (["closed", "failed"], ["failed", "failed"])
    assert (await client.post(COMPLETIONS, json={"prompt": "ok", "max_tokens": 1})).status_code == 200


@pytest.mark.parametrize("prompt,kind", [(FAIL_ENGINE, "server_error"), (FAIL_ADMISSION, "invalid_request_error")])
async def test_stream_errors_become_an_error_event(client: httpx.AsyncClient, prompt: str, kind: str) -> None:
    r = await client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 5, "stream": True})
    assert r.status_code == 200  # headers were sent before the engine failed
    *_, last = sse_events(r.text)
    assert set(last) == {"error"} and last["error"]["type"] == kind


# --- a real server: the openai client, and clients that walk away ---------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine()
    with running_server(engine) as base:  # type: ignore[arg-type]
        yield base, engine
    assert engine.running() == []


def wait_until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def slow(served: tuple[str, FakeEngine]) -> Iterator[tuple[str, FakeEngine]]:
    base, engine = served
    engine.token_delay = 0.02
    try:
        yield base, engine
    finally:
        engine.token_delay = 0.0


def test_openai_client_round_trips(served: tuple[str, FakeEngine]) -> None:
    base, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    comp = client.completions.create(model="fake-model", prompt="hello", max_tokens=3)
    assert comp.choices[0].text == "oll" and comp.usage.total_tokens == 9
    streamed = client.completions.create(model="fake-model", prompt="hello", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "oll"
    chat = client.chat.completions.create(model="fake-model", messages=USER_HI, max_tokens=3)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == ">|t"
    chunks = list(client.chat.completions.create(model="fake-model", messages=USER_HI, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ">|t"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_openai_client_n_and_logprobs(served: tuple[str, FakeEngine]) -> None:
    base, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    comp = client.completions.create(model="fake-model", prompt="abcd", n=2, seed=5, max_tokens=3, logprobs=2)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text != comp.choices[1].text
    assert comp.choices[0].logprobs.tokens == list(comp.choices[0].text)
    assert len(comp.choices[0].logprobs.top_logprobs[0]) == 2
    chat = client.chat.completions.create(model="fake-model", messages=USER_HI, n=2, max_tokens=2, logprobs=True,
                                          top_logprobs=3)
    assert len(chat.choices) == 2
    entry = chat.choices[0].logprobs.content[0]
    assert entry.token == ">" and entry.bytes == [62] and len(entry.top_logprobs) == 3


def test_openai_client_errors(served: tuple[str, FakeEngine]) -> None:
    base, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake-model", messages=USER_HI, temperature=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="y" * 300)
    with pytest.raises(openai.APIError, match="engine exploded"):
        list(client.completions.create(model="fake-model", prompt=FAIL_ENGINE, stream=True))
    assert client.completions.create(model="fake-model", prompt="ok", max_tokens=1).choices[0].text == "k"


@pytest.mark.parametrize("path,req,first_chunks", [
    (COMPLETIONS, {"prompt": "walk away"}, 1),
    (COMPLETIONS, {"prompt": "walk away", "n": 2}, 1),
    (CHAT, {"messages": USER_HI}, 1),  # only the role chunk: no engine output read yet
    (CHAT, {"messages": USER_HI, "n": 2}, 3),
])
def test_stream_disconnect_closes_engine_streams(slow: tuple[str, FakeEngine], path: str, req: dict[str, Any],
                                                 first_chunks: int) -> None:
    base, engine = slow
    body = {**req, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", base + path, json=body) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            rid = json.loads(next(lines)[len("data: "):])["id"]
            for _ in range(first_chunks - 1):
                next(lines)
    # 200 tokens take 4 s: an engine stream still open would end "finished", never "closed",
    # so a generous deadline tells the two apart on a slow machine too.
    n = req.get("n", 1)
    assert wait_until(lambda: engine.states(rid).values() and all(
        s == "closed" for s in engine.states(rid).values()) and len(engine.states(rid)) == n, 60.0), engine.states(rid)
    assert engine.running() == []


def test_non_stream_disconnect_cancels_the_work(slow: tuple[str, FakeEngine]) -> None:
    base, engine = slow
    before = set(engine.calls)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + COMPLETIONS, json={"prompt": "gone", "n": 2, "max_tokens": 200, "ignore_eos": True},
                   timeout=0.3)

    def started() -> dict[str, str]:
        return {rid: c.state for rid, c in engine.calls.items() if rid not in before}

    assert wait_until(lambda: len(started()) == 2 and set(started().values()) == {"closed"}, 60.0), started()
    r = httpx.post(base + COMPLETIONS, json={"prompt": "ok", "max_tokens": 1}, timeout=5)
    assert r.status_code == 200
