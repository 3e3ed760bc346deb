"""The OpenAI Batch file format: input lines `{custom_id, method, url, body}`, output
lines `{id, custom_id, response: {status_code, request_id, body}, error}`."""

from __future__ import annotations

import hashlib
import itertools
import json
import uuid
from dataclasses import dataclass
from typing import Any

from prelude.entrypoints.openai.protocol import first_unencodable


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: Any


class LineError(Exception):
    """A line that can not be run at all; it still gets an output line, carrying `error`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def id_hash(custom_id: str) -> int:
    """64 bits of a custom_id: what the planner and the resume log keep instead of the string."""
    return int.from_bytes(hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def load_object(raw: bytes, number: int) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except RecursionError:  # valid JSON nested deeper than Python's parser goes
        raise LineError("invalid_json_line", f"line {number}: the JSON is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LineError("invalid_json_line", f"line {number}: not valid JSON: {exc}") from None
    except ValueError:  # what else json raises: an integer of over 4,300 digits
        raise LineError("invalid_json_line", f"line {number}: a number of over 4,300 digits") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_json_line", f"line {number}: a batch line must be a JSON object")
    return obj


def custom_id_of(obj: dict[str, Any], number: int) -> str:
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError("missing_custom_id", f"line {number}: custom_id must be a non-empty string")
    if first_unencodable(cid) is not None:  # JSON's "\ud800": no UTF-8 output line could carry it
        raise LineError("invalid_custom_id", f"line {number}: custom_id holds a lone surrogate, which is not a "
                                             "Unicode character")
    return cid


def custom_id_or_none(raw: bytes, number: int) -> str | None:
    """The line's custom_id for the output line of a line that cannot run, where it has a
    usable one."""
    try:
        return custom_id_of(load_object(raw, number), number)
    except LineError:
        return None


def parse_line(obj: dict[str, Any], number: int) -> BatchLine:
    """The request of a JSON object that has a custom_id; LineError for a bad method or body."""
    cid = custom_id_of(obj, number)
    method = obj.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        raise LineError("invalid_method", f"line {number}: method must be POST, not {method!r}")
    url = obj.get("url")
    if not isinstance(url, str):
        raise LineError("invalid_url", f"line {number}: url must be a string such as /v1/chat/completions")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", f"line {number}: body must be a JSON object")
    return BatchLine(cid, url.split("?", 1)[0], body)


_ID_PREFIX = uuid.uuid4().hex[:16]  # random per process ...
_ID_COUNT = itertools.count()  # ... then a counter: unique ids without a urandom call each (two a line)


def _request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNT):016x}"


def response_line(custom_id: str, status: int, body: bytes) -> bytes:
    """An answered line. `body` is the route's JSON answer, embedded as it is."""
    head = json.dumps({"id": f"batch_req_{_request_id()}", "custom_id": custom_id}, ensure_ascii=False)[:-1]
    return (f'{head}, "response": {{"status_code": {status}, "request_id": "{_request_id()}", "body": '
            ).encode() + body + b'}, "error": null}\n'


def error_line(custom_id: str | None, code: str, message: str) -> bytes:
    """A line that got no answer (malformed, bad method): `response` is null."""
    return (json.dumps({"id": f"batch_req_{_request_id()}", "custom_id": custom_id, "response": None,
                        "error": {"code": code, "message": message}}, ensure_ascii=False) + "\n").encode()


def succeeded(line: dict[str, Any]) -> bool:
    """Whether an output line is a 2xx answer (the output file's; the rest go to the error file)."""
    response = line.get("response") or {}
    status = response.get("status_code", 0) if isinstance(response, dict) else 0
    return line.get("error") is None and isinstance(status, int) and 200 <= status < 300


def shared_part(obj: dict[str, Any]) -> str | None:
    """The beginning of `prefix_text` that lines of one rubric share by construction: a
    chat's messages before the last one (system rubric, few-shot turns). None for prompts
    with no such structure."""
    body = obj.get("body")
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or len(messages) < 2:
        return None
    return prefix_text({**obj, "body": {**body, "messages": messages[:-1]}})


def prefix_text(obj: dict[str, Any]) -> str:
    """The text a line's prompt starts with, as far as the planner needs it: lines whose
    texts share a beginning share the prompt's first tokens (and so KV blocks)."""
    body = obj.get("body")
    head = f"{obj.get('url')}\0"
    if not isinstance(body, dict):
        return head
    head += f"{body.get('model')}\0"
    messages = body.get("messages")
    if isinstance(messages, list):
        return head + "".join(f"\1{m.get('role')}\2{m.get('content')}" if isinstance(m, dict) else str(m)
                              for m in messages)
    for key in ("prompt", "input", "query", "text_1", "queries"):
        value = body.get(key)
        if isinstance(value, str):
            return head + value
        if isinstance(value, list) and value:
            return head + (value[0] if isinstance(value[0], str) else json.dumps(value[:4096]))
    return head + json.dumps(body, sort_keys=True)
