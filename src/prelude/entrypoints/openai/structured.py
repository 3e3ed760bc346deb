"""vLLM's structured-output request fields -> one StructuredOutput (or none).

Accepted: `response_format` ({"type": "json_schema", "json_schema": {"schema": ...}},
{"type": "json_object"}, {"type": "text"}), `structured_outputs` ({"json" | "regex" |
"choice" | "grammar" | "json_object": ...}) and the older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. At most one constraint per request.
"""

from __future__ import annotations

import json
from typing import Any

from prelude.entrypoints.openai.errors import APIError
from prelude.params import StructuredOutput


def _json_spec(schema: Any, param: str) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise APIError(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(f"{param} must be a JSON schema object", param=param)
    return StructuredOutput("json", json.dumps(schema))


def _from_response_format(rf: dict[str, Any]) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        body = rf.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise APIError("response_format.json_schema.schema is required", param="response_format")
        return _json_spec(body["schema"], "response_format.json_schema.schema")
    raise APIError("response_format.type must be text, json_object or json_schema", param="response_format")


def _from_fields(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return _json_spec(value, param)
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(f"{param} must be a non-empty list of non-empty strings", param=param)
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise APIError(f"{param} must be a non-empty string", param=param)
    return StructuredOutput(kind, value)


def structured_output(req: Any) -> StructuredOutput | None:
    """The request's constraint; APIError (400) if it is malformed or if several are given."""
    found: list[tuple[str, StructuredOutput | None]] = []
    if req.response_format is not None:
        found.append(("response_format", _from_response_format(req.response_format)))
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.items() if v not in (None, False)}
        unknown = set(given) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise APIError(f"unsupported structured_outputs field {sorted(unknown)[0]!r}", param="structured_outputs")
        for kind, value in given.items():
            found.append((f"structured_outputs.{kind}", _from_fields(kind, value, f"structured_outputs.{kind}")))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", _from_fields(kind, value, f"guided_{kind}")))
    constraints = [(name, spec) for name, spec in found if spec is not None]
    if len(constraints) > 1:
        raise APIError(f"give one structured output constraint, got {', '.join(n for n, _ in constraints)}",
                       param=constraints[1][0])
    return constraints[0][1] if constraints else None
