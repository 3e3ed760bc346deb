"""How a typed question is put to a chat model, and which tokens its answers are.

Every question is asked as one more user turn after the input's messages, rendered with the
model's chat template (thinking turned off where the template has it), and its options are
read as what the assistant answers first:

    <the input's messages><user turn: the question text><assistant turn opens>ANSWER

The question text (docs/decision-apis.md shows it):

    predicate  "{instructions}\n\nIs this true of the input above? Answer Yes or No."
    choice     "{instructions}\n\nOptions:\n- {label}[: {description}]...\n\n"
               "Answer with exactly one option, as written above."
    score      "{instructions}\n\nLevels, from lowest to highest:\n- {label}[: ...]...\n\n"
               "Answer with exactly one level, as written above."

A predicate's options are `Yes` and `No` (with System One's criteria listed as for a choice);
a choice's are its values (booleans as `true`/`false`; strings as JSON only when one would
read as a boolean beside it); a score's are its levels' labels (System One: "0".."n-1").

The rendered input is the shared prefix of every question, the text before the first
question's turn, tokenized once; each question's turn and answer lead-in is an item after it.
An option is scored on its whole token sequence; when one option's tokens begin another's
(`cat` / `category`), every option of that question ends with the template's end-of-turn
token, so that no option's probability holds another's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prelude.engine.client import EngineClient
from prelude.entrypoints.openai.decision_protocol import Asked, DecisionInput
from prelude.entrypoints.openai.errors import APIError

# Chat templates with a thinking switch (Qwen3's `enable_thinking`) answer directly.
TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": False}
_END_MARK = "\x00decision-end\x00"  # a text no template holds: where an assistant's turn text ends


def question_text(q: Asked) -> str:
    if q.kind == "predicate":
        text = f"{q.instructions}\n\nIs this true of the input above? Answer Yes or No."
        described = [o for o in q.options if o.description]
        if described:
            text += "\n" + "\n".join(f"- {o.label}: {o.description}" for o in described)
        return text
    heading = "Options:" if q.kind == "choice" else "Levels, from lowest to highest:"
    lines = "\n".join(f"- {o.label}: {o.description}" if o.description else f"- {o.label}" for o in q.options)
    what = "option" if q.kind == "choice" else "level"
    return f"{q.instructions}\n\n{heading}\n{lines}\n\nAnswer with exactly one {what}, as written above."


@dataclass(frozen=True)
class Rendered:
    """The token ids a request's questions are read from."""

    prefix: list[int]  # the rendered input: shared by every question
    items: list[list[int]]  # per question: its turn and the assistant's lead-in
    labels: list[list[list[int]]]  # per question, per option: the answer's token ids


def _render(engine: EngineClient, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                    **TEMPLATE_KWARGS)
    except ValueError as exc:  # no chat template
        raise APIError(f"model: this model has no chat template; typed decisions need one ({exc})",
                       param="model") from exc
    except Exception as exc:  # a template's raise_exception() or a render error: the input's fault
        raise APIError(f"input: chat template error: {exc}", param="input") from exc


def _common_prefix(texts: list[str]) -> str:
    first, last = min(texts), max(texts)  # the common prefix of all is that of the extremes
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def _end_of_turn(engine: EngineClient) -> int:
    """The first token the template writes after an assistant's text (its end of turn)."""
    text = _render(engine, [{"role": "user", "content": "?"}, {"role": "assistant", "content": _END_MARK}], False)
    after = text[text.rindex(_END_MARK) + len(_END_MARK):] if _END_MARK in text else ""
    ids = engine.tokenizer.encode(after, add_special_tokens=False) if after.strip() else []
    return ids[0] if ids else min(engine.tokenizer.eos_token_ids)


def _is_proper_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) < len(b) and b[: len(a)] == a


def option_ids(engine: EngineClient, q: Asked, param: str) -> list[list[int]]:
    encode = engine.tokenizer.encode
    ids = [encode(o.label, add_special_tokens=False) for o in q.options]
    for j, toks in enumerate(ids):
        if not toks:
            raise APIError(f"{param}.{j}: the option has no tokens", param=f"{param}.{j}")
        if toks in ids[:j]:
            raise APIError(f"{param}.{j}: the option reads as the same tokens as option {ids.index(toks)}",
                           param=f"{param}.{j}")
    if any(_is_proper_prefix(a, b) for a in ids for b in ids):
        end = _end_of_turn(engine)
        ids = [toks + [end] for toks in ids]
    return ids


def render(engine: EngineClient, source: DecisionInput, questions: list[Asked], params: list[str]) -> Rendered:
    """Token ids of the input (shared) and of each question after it. `params`: each
    question's options field, for errors."""
    messages = list(source.messages)
    shared_text = _render(engine, messages, False)
    fulls = [_render(engine, messages + [{"role": "user", "content": question_text(q)}], True) for q in questions]
    if not all(f.startswith(shared_text) for f in fulls):
        # A template that renders the last turn apart from earlier ones: the shared part is
        # what every rendering with a question after the input holds (a probe question
        # bounds it, so that it does not depend on how the request's questions begin).
        probe = _render(engine, messages + [{"role": "user", "content": "?"}], True)
        shared_text = _common_prefix([probe, *fulls])
    encode = engine.tokenizer.encode
    prefix = encode(shared_text, add_special_tokens=False)
    if not prefix:
        raise APIError("input: the rendered input is empty", param="input")
    items = [encode(f[len(shared_text):], add_special_tokens=False) for f in fulls]
    labels = [option_ids(engine, q, p) for q, p in zip(questions, params)]
    return Rendered(prefix, items, labels)
