"""How typed questions are rendered (decision_prompts.py), model-free: the shared input,
each question's item, thinking turned off, templates that rewrite earlier turns, and
options that begin one another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from prelude.entrypoints.openai.decision_prompts import question_text, render
from prelude.entrypoints.openai.decision_protocol import decision_input, decision_questions
from prelude.entrypoints.openai.errors import APIError

from tests.engine.tiny import ByteTokenizer


class ThinkingTemplate(ByteTokenizer):
    """Qwen3-like: a generation prompt with thinking off holds an empty think block, and an
    assistant turn ends with <eot>."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kw: Any) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" + ("<eot>" if m["role"] == "assistant" else "")
                       for m in messages)
        if add_generation_prompt:
            text += "<assistant>" + ("<think></think>" if kw.get("enable_thinking") is False else "")
        return text


class LastTurnMarked(ByteTokenizer):
    """A template that renders the last message differently from earlier ones."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kw: Any) -> str:
        return "".join(("<last>" if i == len(messages) - 1 else "") + f"<{m['role']}>{m['content']}"
                       for i, m in enumerate(messages)) + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Engine:
    tokenizer: Any


QUESTIONS = [{"type": "predicate", "instructions": "It rains."},
             {"type": "choice", "instructions": "Pick.", "choices": [{"value": "cat"}, {"value": "category"}]}]


def _text(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode()


def test_thinking_is_off_and_the_input_is_the_shared_prefix() -> None:
    r = render(_Engine(ThinkingTemplate()), decision_input("hello"), decision_questions(QUESTIONS), ["a", "b"])
    assert _text(r.prefix) == "<user>hello"
    assert _text(r.items[0]).endswith("Answer Yes or No.<assistant><think></think>")
    assert _text(r.items[0]).startswith("<user>It rains.")
    # "cat" begins "category": both end with the template's end-of-turn (its first token)
    assert r.labels[1] == [list(b"cat") + [ord("<")], list(b"category") + [ord("<")]]
    assert r.labels[0] == [list(b"Yes"), list(b"No")]


def test_a_template_that_rewrites_earlier_turns_shares_only_the_common_prefix() -> None:
    engine = _Engine(LastTurnMarked())
    r = render(engine, decision_input("hello"), decision_questions(QUESTIONS), ["a", "b"])
    for q, item in zip(decision_questions(QUESTIONS), r.items):
        messages = [{"role": "user", "content": "hello"}, {"role": "user", "content": question_text(q)}]
        assert _text(r.prefix + item) == engine.tokenizer.apply_chat_template(messages)
        assert item
    assert _text(r.prefix) == "<user>hello<last><user>"  # the part every question's rendering shares


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_model() -> None:
    class Plain(ByteTokenizer):
        def apply_chat_template(self, *a: Any, **kw: Any) -> str:
            raise ValueError("no chat template")

    with pytest.raises(APIError) as err:
        render(_Engine(Plain()), decision_input("hello"), decision_questions(QUESTIONS), ["a", "b"])
    assert err.value.param == "model" and err.value.status == 400
