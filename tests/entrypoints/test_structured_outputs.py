"""Structured-output request fields over HTTP (tiny random Llama): response_format,
structured_outputs, guided_*; streaming, n > 1, chat; malformed constraints get a 400."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("transformers")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "s": {"type": "string", "maxLength": 3}},
          "required": ["n", "s"], "additionalProperties": False}


def _post(base: str, path: str, body: object) -> httpx.Response:
    return httpx.post(base + path, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=120)


def test_response_format_json_schema_chat_and_n(served) -> None:  # noqa: ANN001
    base, engine = served
    body = {"messages": [{"role": "user", "content": "json"}], "max_tokens": 120, "n": 3, "seed": 7,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    r = _post(base, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"n", "s"} and 0 <= value["n"] <= 9 and len(value["s"]) <= 3
    engine.check_integrity()


def test_guided_fields_on_completions_and_streaming(served) -> None:  # noqa: ANN001
    base, _ = served
    r = _post(base, "/v1/completions", {"prompt": "id:", "max_tokens": 20, "seed": 1, "guided_regex": r"[a-c]{4}"})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"[a-c]{4}", r.json()["choices"][0]["text"])
    r = _post(base, "/v1/completions", {"prompt": "pick:", "max_tokens": 1, "guided_choice": ["y", "n"]})
    assert r.json()["choices"][0]["text"] in ("y", "n")  # one constrained token: a OneShot label decision
    r = _post(base, "/v1/completions", {"prompt": "go", "max_tokens": 60, "seed": 2,
                                        "structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.json()["choices"][0]["text"] in ("alpha", "beta")
    with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
            "prompt": "j", "max_tokens": 120, "seed": 3, "stream": True, "guided_json": SCHEMA}) as s:
        text = ""
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert set(json.loads(text)) == {"n", "s"}


BAD = [
    {"guided_json": {"type": "nope"}},
    {"guided_json": "{not json"},
    {"guided_regex": "((("},
    {"guided_choice": []},
    {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "xml"}},
    {"structured_outputs": {"yaml": "x"}},
    {"guided_regex": "a", "guided_choice": ["a"]},  # two constraints
    {"guided_grammar": "start: nothing_defined"},
]


@pytest.mark.parametrize("extra", BAD, ids=[str(i) for i in range(len(BAD))])
def test_malformed_constraints_get_400(served, extra: dict) -> None:  # noqa: ANN001
    base, engine = served
    r = _post(base, "/v1/completions", {"prompt": "x", "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    engine.check_integrity()
