"""Request bodies of the typed-decision routes, and their reading into `Asked` questions.

- `/v1/decisions`: OpenAI's Decisions API (the `openai` package's `decision_create_params`):
  `input` (a string, or messages whose parts are text and JSON) and 1-400 `questions`
  (`predicate`, `choice` with 2-255 typed values, `score` with 2-10 ordered levels).
- `/v1/systemone`: TypeSafe's System One (`state`, `questions` keyed by id, each `noul`,
  `choice` or `score` with `criteria`).

The bodies' fields are checked here, by hand rather than by pydantic unions, so that every
refusal is a 400 naming the exact field (`questions.3.choices.1.value`), never a list of
the union's forms. Unknown fields are refused: a field this server does not know could
change what the caller meant to ask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field

from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.protocol import RequestBody

MAX_QUESTIONS = 400
MIN_CHOICES, MAX_CHOICES = 2, 255
MIN_LEVELS, MAX_LEVELS = 2, 10
PREDICATE_LABELS = ("Yes", "No")  # what a predicate's answer is read as (a chat turn's first word); P(true) = P(Yes)

Kind = Literal["predicate", "choice", "score"]
ChoiceValue = str | bool


@dataclass(frozen=True)
class Option:
    """One answer a question may get: its value as the API returns it, and the text the
    model is asked to answer with (and is scored on)."""

    value: ChoiceValue | int  # a choice's typed value, a level's index, or the predicate's True/False
    label: str
    description: str | None = None


@dataclass(frozen=True)
class Asked:
    """One question as the model is asked it."""

    kind: Kind
    name: str | None
    instructions: str
    options: tuple[Option, ...]


@dataclass(frozen=True)
class DecisionInput:
    """The conversation every question is asked about, as chat-template messages."""

    messages: tuple[dict[str, str], ...]


class _Extensions(RequestBody):
    """Prelude's fields on both routes (absent from the peers' shapes)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    # SGLang's name: return, with every answer, the prompt ids it was read from and each
    # option's label ids, so a caller can check the reading.
    return_prompt_token_ids: bool = False
    # Pack every question after the input in one forward (False: one row per question).
    multi_item: bool = True


class DecisionRequest(_Extensions):
    """OpenAI's POST /v1/decisions body."""

    input: str | list[dict[str, Any]]
    questions: list[Any]
    # Prelude: below this much probability on its options (their total, under the whole
    # vocabulary) a question is answered with a refusal; None: the server's default.
    refusal_threshold: float | None = Field(default=None, ge=0, le=1)
    prompt_cache_key: str | None = None  # a hint: the prefix cache is shared and automatic
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None


class SystemOneRequest(_Extensions):
    """TypeSafe's POST /v1/systemone body."""

    state: Any
    questions: dict[str, Any]


# --- reading and checking ---------------------------------------------------------------


def _fail(message: str, param: str) -> APIError:
    return APIError(f"{param}: {message}", param=param)


def _object(value: Any, param: str, allowed: set[str], required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail("must be an object", param)
    for key in value:
        if key not in allowed:
            raise _fail(f"unknown field {key!r}", f"{param}.{key}")
    for key in required:
        if key not in value:
            raise _fail("is required", f"{param}.{key}")
    return value


def _text(value: Any, param: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise _fail("must be a string", param)
    if not allow_empty and not value.strip():
        raise _fail("must not be empty", param)
    return value


def _json_text(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _parts_text(value: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A string, or a list of parts joined by newlines. `input_image` is refused: no
    vision model is served."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise _fail("must be a string or a non-empty list of content parts", param)
    texts = []
    for j, part in enumerate(value):
        where = f"{param}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            raise APIError(f"{where}: images are not supported: this server serves a text-only model",
                           param=where, code="unsupported_content")
        if kind not in kinds:
            raise _fail(f"type must be one of {', '.join(kinds)}, got {kind!r}", f"{where}.type")
        if kind in ("input_text", "output_text"):
            part = _object(part, where, {"type", "text", "prompt_cache_breakpoint"}, ("text",))
            texts.append(_text(part["text"], f"{where}.text", allow_empty=True))
        elif kind == "input_json":
            part = _object(part, where, {"type", "data"}, ("data",))
            if not isinstance(part["data"], (dict, list)):
                raise _fail("must be a JSON object or an array of objects", f"{where}.data")
            texts.append(_json_text(part["data"]))
        else:  # an assistant's earlier refusal, kept as its text
            part = _object(part, where, {"type", "refusal"}, ("refusal",))
            texts.append(_text(part["refusal"], f"{where}.refusal", allow_empty=True))
    return "\n".join(texts)


_PART_KINDS = {
    "user": ("input_text", "input_json", "input_image"),
    "system": ("input_text",),
    "developer": ("input_text",),
    "assistant": ("output_text", "refusal"),
}


def decision_input(value: str | list[dict[str, Any]]) -> DecisionInput:
    """OpenAI's `input`: a user's text, or messages. A developer message is a system turn
    (the chat templates served know no developer role)."""
    if isinstance(value, str):
        return DecisionInput(({"role": "user", "content": _text(value, "input")},))
    if not value:
        raise _fail("must not be empty", "input")
    messages = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _fail("must be a message object", where)
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(f"{where}.type: {kind!r} items are not supported; send messages", param=f"{where}.type",
                           code="unsupported_content")
        role = item.get("role")
        if role not in _PART_KINDS:
            raise _fail(f"role must be user, system, developer or assistant, got {role!r}", f"{where}.role")
        allowed = {"type", "role", "content"} | ({"phase"} if role == "assistant" else set())
        _object(item, where, allowed, ("content",))
        text = _parts_text(item["content"], f"{where}.content", _PART_KINDS[role])
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    return DecisionInput(tuple(messages))


def _choice_label(value: ChoiceValue, quoted: bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False) if quoted else value


def _choice_options(raw: Any, param: str) -> tuple[Option, ...]:
    if not isinstance(raw, list) or not MIN_CHOICES <= len(raw) <= MAX_CHOICES:
        n = len(raw) if isinstance(raw, list) else "no"
        raise _fail(f"{n} choices; a choice question takes {MIN_CHOICES} to {MAX_CHOICES}", param)
    seen: set[tuple[type, ChoiceValue]] = set()
    values: list[tuple[ChoiceValue, str | None]] = []
    for j, choice in enumerate(raw):
        where = f"{param}.{j}"
        choice = _object(choice, where, {"value", "description"}, ("value",))
        value = choice["value"]
        if not isinstance(value, (str, bool)):
            raise _fail("must be a string or a boolean", f"{where}.value")
        if isinstance(value, str):
            _text(value, f"{where}.value")
        if (type(value), value) in seen:
            raise _fail(f"duplicate choice {value!r}", f"{where}.value")
        seen.add((type(value), value))
        description = choice.get("description")
        values.append((value, None if description is None else _text(description, f"{where}.description", True)))
    # Typed values: a string "true" beside the boolean true would read as the same answer,
    # so then every value of the question is written as JSON ("true" vs true).
    texts = {_choice_label(v, False) for v, _ in values}
    quoted = len(texts) < len(values)
    return tuple(Option(v, _choice_label(v, quoted), d) for v, d in values)


def _level_options(raw: Any, param: str) -> tuple[Option, ...]:
    if not isinstance(raw, list) or not MIN_LEVELS <= len(raw) <= MAX_LEVELS:
        n = len(raw) if isinstance(raw, list) else "no"
        raise _fail(f"{n} levels; a score question takes {MIN_LEVELS} to {MAX_LEVELS}", param)
    options = []
    for j, level in enumerate(raw):
        where = f"{param}.{j}"
        level = _object(level, where, {"label", "description"}, ("label",))
        label = _text(level["label"], f"{where}.label")
        if any(o.label == label for o in options):
            raise _fail(f"duplicate level {label!r}", f"{where}.label")
        description = level.get("description")
        options.append(Option(j, label, None if description is None else _text(description, f"{where}.description",
                                                                              True)))
    return tuple(options)


def _predicate_options(true: str | None = None, false: str | None = None) -> tuple[Option, ...]:
    return (Option(True, PREDICATE_LABELS[0], true), Option(False, PREDICATE_LABELS[1], false))


_QUESTION_FIELDS: dict[str, set[str]] = {
    "predicate": {"type", "name", "instructions"},
    "choice": {"type", "name", "instructions", "choices"},
    "score": {"type", "name", "instructions", "levels"},
}


def decision_questions(raw: list[Any]) -> list[Asked]:
    """OpenAI's `questions`, in order."""
    if not 1 <= len(raw) <= MAX_QUESTIONS:
        raise _fail(f"{len(raw)} questions; a request asks 1 to {MAX_QUESTIONS}", "questions")
    asked = []
    for i, q in enumerate(raw):
        where = f"questions.{i}"
        if not isinstance(q, dict):
            raise _fail("must be a question object", where)
        kind = q.get("type")
        if kind not in _QUESTION_FIELDS:
            raise _fail(f"type must be predicate, choice or score, got {kind!r}", f"{where}.type")
        required = ("instructions", "choices" if kind == "choice" else "levels" if kind == "score" else "instructions")
        q = _object(q, where, _QUESTION_FIELDS[kind], required)
        name = q.get("name")
        if name is not None and not isinstance(name, str):
            raise _fail("must be a string", f"{where}.name")
        instructions = _parts_text(q["instructions"], f"{where}.instructions", ("input_text", "input_json",
                                                                                 "input_image"))
        _text(instructions, f"{where}.instructions")
        if kind == "predicate":
            options = _predicate_options()
        elif kind == "choice":
            options = _choice_options(q["choices"], f"{where}.choices")
        else:
            options = _level_options(q["levels"], f"{where}.levels")
        asked.append(Asked(kind, name, instructions, options))
    return asked


def systemone_state(value: Any) -> DecisionInput:
    """TypeSafe's `state`: text as it is, anything else as JSON text, in one user turn."""
    if value is None:
        raise _fail("is required", "state")
    text = value if isinstance(value, str) else _json_text(value)
    return DecisionInput(({"role": "user", "content": _text(text, "state")},))


_SYSTEMONE_KINDS = {"noul": "predicate", "choice": "choice", "score": "score"}


def systemone_questions(raw: dict[str, Any]) -> list[tuple[str, Asked]]:
    """TypeSafe's `questions`, keyed by the caller's ids (which the model never sees)."""
    if not 1 <= len(raw) <= MAX_QUESTIONS:
        raise _fail(f"{len(raw)} questions; a request asks 1 to {MAX_QUESTIONS}", "questions")
    out = []
    for key, q in raw.items():
        where = f"questions.{key}"
        if not isinstance(q, dict):
            raise _fail("must be a question object", where)
        kind = q.get("type")
        if kind not in _SYSTEMONE_KINDS:
            raise _fail(f"type must be noul, choice or score, got {kind!r}", f"{where}.type")
        q = _object(q, where, {"type", "instructions", "criteria"},
                    ("instructions",) if kind == "noul" else ("instructions", "criteria"))
        instructions = _text(q["instructions"], f"{where}.instructions")
        criteria = q.get("criteria")
        if kind == "noul":
            if criteria is None:
                options = _predicate_options()
            else:
                crit = _object(criteria, f"{where}.criteria", {"true", "false"})
                options = _predicate_options(*(None if crit.get(k) is None else
                                               _text(crit[k], f"{where}.criteria.{k}", True) for k in ("true", "false")))
        elif kind == "choice":
            if isinstance(criteria, list):
                entries = [{"value": _text(c, f"{where}.criteria.{j}")} for j, c in enumerate(criteria)]
            elif isinstance(criteria, dict):
                entries = [{"value": k, **({} if d is None else {"description": d})} for k, d in criteria.items()]
            else:
                raise _fail("must map each option to its description (or list the options)", f"{where}.criteria")
            options = _choice_options(entries, f"{where}.criteria")
        else:
            if not isinstance(criteria, list):
                raise _fail("must list the levels' descriptions, lowest first", f"{where}.criteria")
            options = _level_options([{"label": str(j), "description": _text(d, f"{where}.criteria.{j}")}
                                      for j, d in enumerate(criteria)], f"{where}.criteria")
        out.append((key, Asked(_SYSTEMONE_KINDS[kind], key, instructions, options)))  # type: ignore[arg-type]
    return out

