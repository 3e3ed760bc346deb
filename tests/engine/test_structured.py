"""Structured outputs on the engine (tiny random Llama, byte tokenizer): whatever the
random model prefers, the generated JSON parses and validates against its schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prelude.engine.client import InvalidRequestError
from prelude.engine.engine import LLMEngine
from prelude.params import SamplingParams, StructuredOutput

from tests.engine.tiny import hf_tiny_llama, tiny_engine

hypothesis = pytest.importorskip("hypothesis")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return tiny_engine(hf_tiny_llama(), num_blocks=512, max_num_seqs=32, max_num_batched_tokens=512)


def generate(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, tuple[str, str]]:
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    text: dict[str, str] = {}
    done: dict[str, tuple[str, str]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id] = text.get(out.request_id, "") + out.text
            if out.finished:
                assert out.finish_reason is not None
                done[out.request_id] = (text[out.request_id], out.finish_reason.value)
    engine.check_integrity()
    return done


# Bounded schemas: every value has a finite size, so a constrained generation ends.
names = st.sampled_from(["a", "b", "id", "name", "ok", "x_y"])
leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3,
                                                unique=True)),
)


def _object(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": [r for r in required if r in props],
            "additionalProperties": False}


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(names, children, min_size=1, max_size=3)
    return st.builds(_object, props, st.lists(names, max_size=3, unique=True))


inner = st.one_of(leaf, st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, leaf,
                                  st.integers(0, 2)))
schemas = st.one_of(_objects(inner), _objects(st.one_of(inner, _objects(leaf))),
                    st.builds(lambda item: {"type": "array", "items": item, "maxItems": 3}, _objects(leaf)))


def check_batch(engine: LLMEngine, batch: list[dict[str, Any]]) -> None:
    requests = [(f"s{i}", list(b"JSON please: "),
                 SamplingParams(max_tokens=490, temperature=1.0, seed=i,
                                structured=StructuredOutput("json", json.dumps(schema))))
                for i, schema in enumerate(batch)]
    done = generate(engine, requests)
    for i, schema in enumerate(batch):
        text, reason = done[f"s{i}"]
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(schemas, min_size=6, max_size=6))
def test_generated_json_always_parses_and_validates(engine: LLMEngine, batch: list[dict[str, Any]]) -> None:
    check_batch(engine, batch)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(schemas, min_size=8, max_size=8))
def test_generated_json_always_parses_and_validates_many(engine: LLMEngine, batch: list[dict[str, Any]]) -> None:
    check_batch(engine, batch)


def test_regex_choice_and_json_object(engine: LLMEngine) -> None:
    done = generate(engine, [
        ("re", list(b"id: "), SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                             structured=StructuredOutput("regex", r"[A-Z]{2}-[0-9]{3}"))),
        ("ch", list(b"pick: "), SamplingParams(max_tokens=10, temperature=1.0, seed=4,
                                               structured=StructuredOutput("choice", json.dumps(["red", "green"])))),
        ("obj", list(b"{"), SamplingParams(max_tokens=400, temperature=0.0,
                                           structured=StructuredOutput("json_object"))),
        ("one", list(b"yes or no: "), SamplingParams(max_tokens=1, temperature=1.0, seed=5,  # OneShot
                                                     structured=StructuredOutput("choice", json.dumps(["y", "n"])))),
    ])
    import re

    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", done["re"][0]) and done["re"][1] == "stop"
    assert done["ch"][0] in ("red", "green")
    assert done["one"][0] in ("y", "n")
    text, reason = done["obj"]
    if reason == "stop":  # greedy on a random model may fill the budget with keys
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize("spec", [
    StructuredOutput("json", '{"type": "nope"}'),
    StructuredOutput("json", '{"type": '),
    StructuredOutput("regex", "((("),
    StructuredOutput("choice", "[]"),
    StructuredOutput("grammar", "start: undefined_rule"),
    StructuredOutput("regex", "[^\\s\\S]"),  # well formed, but no text matches it (was a 200 with "")
    StructuredOutput("json", '{"type": "string", "minLength": 5, "maxLength": 2}'),
])
def test_malformed_constraints_are_refused_at_admission(engine: LLMEngine, spec: StructuredOutput) -> None:
    with pytest.raises(InvalidRequestError):
        engine.prepare("bad", [1, 2, 3], SamplingParams(max_tokens=5, structured=spec))


@pytest.mark.parametrize("spec", [StructuredOutput("regex", ""), StructuredOutput("regex", "ab?")])
def test_a_constraint_that_matches_only_short_text_is_taken(engine: LLMEngine, spec: StructuredOutput) -> None:
    """The empty-text check refuses nothing that matches some text, the empty string included."""
    got = generate(engine, [("short", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, structured=spec))])
    assert got["short"][0] in ("", "a", "ab")
