"""Unknown request fields: refuse the ones that would change what the answer means,
ignore the rest with one warning line, as vLLM does.

Accepting `tools` or `logit_bias` and answering without them would hand a client a
different kind of answer than it asked for, with a 200. (Structured outputs —
`response_format`, `structured_outputs`, `guided_*` — are implemented: see structured.py.)
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from prelude.entrypoints.openai.errors import APIError

logger = logging.getLogger("prelude.server")


def _is_number(value: Any, off: float) -> bool:
    """`value` is the number `off`, not a bool (JSON true is 1 to Python: best_of true is no off value)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == off


# Field -> predicate of the values that change nothing (the field's "off" values).
_ANSWER_CHANGING: dict[str, Any] = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "logit_bias": lambda v: not v,
    "best_of": lambda v: v is None or _is_number(v, 1),
    "use_beam_search": lambda v: not v,
    "length_penalty": lambda v: v is None or _is_number(v, 1),
    "min_tokens": lambda v: v is None or _is_number(v, 0),
    "bad_words": lambda v: not v,
    "allowed_token_ids": lambda v: v is None,
    "truncate_prompt_tokens": lambda v: v is None,
    "prompt_embeds": lambda v: v is None,
    "logits_processors": lambda v: not v,
    "prediction": lambda v: v is None,
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "n_best": lambda v: v is None,
}


def check_unknown_fields(body: BaseModel, route: str) -> None:
    """400 naming the first answer-changing field that is set; one warning for the rest."""
    extra = body.model_extra or {}
    for name, value in extra.items():
        harmless = _ANSWER_CHANGING.get(name)
        if harmless is not None and not harmless(value):
            raise APIError(f"{name} is not supported by this server; the request was not run "
                           "(ignoring it would change what the answer means)", param=name,
                           code="unsupported_parameter")
    ignored = sorted(n for n in extra if n not in _ANSWER_CHANGING)
    if ignored:
        logger.warning("%s: ignoring unknown fields %s", route, ", ".join(ignored))
