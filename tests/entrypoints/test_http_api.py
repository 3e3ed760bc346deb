"""HTTP behaviour over the tiny engine: bad input answered with 400 + OpenAI error body
(and the server keeps serving), n > 1, logprobs shapes, echo, tokenize, auth."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("transformers")

BAD_COMPLETIONS = [
    ("malformed json", "{not json"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -1}),
    ("negative temperature", {"prompt": "x", "temperature": -0.5}),
    ("top_p zero", {"prompt": "x", "top_p": 0}),
    ("top_p above one", {"prompt": "x", "top_p": 1.01}),
    ("wrong type max_tokens", {"prompt": "x", "max_tokens": "many"}),
    ("wrong type stop", {"prompt": "x", "stop": 5}),
    ("wrong type prompt", {"prompt": {"a": 1}}),
    ("empty prompt list", {"prompt": []}),
    ("missing prompt", {"max_tokens": 3}),
    ("too long prompt", {"prompt": "y" * 400, "max_tokens": 1}),
    ("prompt plus max_tokens over context", {"prompt": "y" * 200, "max_tokens": 100}),
    ("n zero", {"prompt": "x", "n": 0}),
    ("logprobs too many", {"prompt": "x", "logprobs": 21}),
    ("out of vocab token", {"prompt": [1, 99999]}),
    ("top_k invalid", {"prompt": "x", "top_k": -5}),
]

BAD_CHAT = [
    ("empty messages", {"messages": []}),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
]


def _post(base: str, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(base + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)


def _assert_openai_error(r: httpx.Response, status: int = 400) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("name,body", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_requests_get_400(served, name: str, body: object) -> None:  # noqa: ANN001
    base, engine = served
    _assert_openai_error(_post(base, "/v1/completions", body))
    ok = _post(base, "/v1/completions", {"prompt": "still", "max_tokens": 2})
    assert ok.status_code == 200
    engine.check_integrity()


@pytest.mark.parametrize("name,body", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_requests_get_400(served, name: str, body: object) -> None:  # noqa: ANN001
    base, _ = served
    _assert_openai_error(_post(base, "/v1/chat/completions", body))


def test_unknown_route_is_404_with_error_body(served) -> None:  # noqa: ANN001
    base, _ = served
    r = httpx.get(base + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_n_choices_seeded_and_usage(served) -> None:  # noqa: ANN001
    base, _ = served
    body = {"prompt": ["ab", "cde"], "n": 2, "max_tokens": 6, "seed": 7, "temperature": 1.0, "ignore_eos": True}
    a = _post(base, "/v1/completions", body).json()
    b = _post(base, "/v1/completions", body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert a["usage"] == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29}


def test_completion_logprobs_echo_and_stop(served) -> None:  # noqa: ANN001
    base, _ = served
    r = _post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 2, "temperature": 0,
                                         "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    echo = _post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True}).json()
    assert echo["choices"][0]["text"] == "hi" and echo["usage"]["completion_tokens"] == 0
    full = _post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    text = full.json()["choices"][0]["text"]
    stop = text[2:4]
    cut = _post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                          "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"


def test_chat_logprobs_shape(served) -> None:  # noqa: ANN001
    base, _ = served
    r = _post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3,
                                              "logprobs": True, "top_logprobs": 2, "ignore_eos": True}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert {"token", "logprob", "bytes", "top_logprobs"} <= set(content[0])
    assert len(content[0]["top_logprobs"]) == 2


def test_tokenize_detokenize_models_health(served) -> None:  # noqa: ANN001
    base, _ = served
    t = _post(base, "/tokenize", {"prompt": "hé"}).json()
    assert t["tokens"] == list("hé".encode()) and t["count"] == 3
    assert _post(base, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == "hé"
    chat = _post(base, "/tokenize", {"messages": [{"role": "user", "content": "x"}]}).json()
    assert bytes(chat["tokens"]).decode() == "<user>x<assistant>"
    _assert_openai_error(_post(base, "/detokenize", {"tokens": [10**6]}))
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.head(base + "/health").status_code == 200  # a probe by HEAD (curl -I)
    metrics = httpx.get(base + "/metrics").text
    assert "prelude:prefix_cache_queries_total" in metrics
    blocks = [line for line in metrics.splitlines() if line.startswith('prelude:kv_blocks{model_name="tiny-llama"')]
    assert len(blocks) == 3 and sum(float(line.split()[-1]) for line in blocks) == 256  # used + free + cached
    assert httpx.get(base + "/v1/models").json()["data"][0]["max_model_len"] == 256


def test_api_key_required_when_set() -> None:
    from prelude.entrypoints.openai.api_server import build_app
    from tests.entrypoints.fake_client import StaticEngine

    app = build_app(StaticEngine(), api_key="sekret")
    import asyncio

    async def run() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            no = await c.get("/v1/models")
            yes = await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
            return no.status_code, yes.status_code

    assert asyncio.run(run()) == (401, 200)
