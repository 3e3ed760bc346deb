"""Text that cannot be UTF-8 encoded (lone surrogates, legal in JSON) gets a 400 naming the
field on every route that takes text; a tokenizer-core panic never reaches a client and is
counted in /metrics."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from prelude.entrypoints.openai.api_server import build_app
from prelude.model.loading.files import load_model_files
from prelude.tokenizer.fasttoken import FastTokenizer

pytest.importorskip("transformers")

S = "\\ud800"  # as JSON spells it: json.loads gives a str holding U+D800

# (route, JSON body with a lone surrogate, the field the error must name)
CASES = [
    ("/v1/completions", f'{{"prompt": "hello {S} world"}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "x{S}"]}}', "prompt.1"),
    ("/v1/completions", f'{{"prompt": "ok", "stop": ["{S}"]}}', "stop.0"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi {S}"}}]}}', "messages.0.content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{S}"}}]}}]}}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", f'{{"model": "m{S}", "messages": [{{"role": "user", "content": "hi"}}]}}', "model"),
    ("/v1/embeddings", f'{{"input": "{S}"}}', "input"),
    ("/v1/classify", f'{{"input": ["a", "{S}"]}}', "input.1"),
    ("/classify", f'{{"input": "{S}", "labels": ["yes"]}}', "input"),
    ("/score", f'{{"text_1": "q", "text_2": ["{S}"]}}', "text_2.0"),
    ("/v1/rerank", f'{{"query": "{S}", "documents": ["d"]}}', "query"),
    ("/rerank", f'{{"query": "q", "documents": [{{"text": "{S}"}}]}}', "documents.0.text"),
    ("/reward", f'{{"input": "{S}"}}', "input"),
    ("/tokenize", f'{{"prompt": "{S}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{S}"}}]}}', "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": "x"}}], "chat_template_kwargs": {{"k{S}": 1}}}}',
     "chat_template_kwargs.k\\ud800"),  # the key, escaped
]


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_unencodable_text_gets_400_naming_the_field(served, path: str, body: str, param: str) -> None:  # noqa: ANN001
    base, engine = served
    r = httpx.post(base + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert "surrogate" in err["message"] and err["message"].startswith(param)
    assert httpx.post(base + "/tokenize", json={"prompt": "still fine"}).status_code == 200
    engine.check_integrity()


def test_a_valid_surrogate_pair_is_just_text(served) -> None:  # noqa: ANN001
    base, _ = served
    r = httpx.post(base + "/tokenize", content='{"prompt": "\\ud83d\\ude00"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"] == list("😀".encode())


class _TokenizerOnly:
    model_name = "m"
    max_model_len = 4096

    def __init__(self, tokenizer: FastTokenizer) -> None:
        self.tokenizer = tokenizer

    def is_healthy(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {"requests_running": 0}


def test_core_panic_answers_200_and_counts_in_metrics() -> None:
    from tests.tokenizer.test_fasttoken import PanickingCore, _real_panic

    fast = FastTokenizer(load_model_files(None).model_dir / "tokenizer.json")
    want = fast.encode("Quick")
    fast._core = PanickingCore(fast._core, _real_panic())  # type: ignore[assignment]
    client = TestClient(build_app(_TokenizerOnly(fast)))  # type: ignore[arg-type]
    def fallbacks() -> float:
        line = next(x for x in client.get("/metrics").text.splitlines()
                    if x.startswith("prelude:tokenizer_fallbacks_total"))
        return float(line.rsplit(" ", 1)[1])

    assert fallbacks() == 0
    r = client.post("/tokenize", json={"prompt": "Quick"})
    assert r.status_code == 200 and r.json()["tokens"] == want
    assert fallbacks() == 1
