"""Large JSON bodies and answers are parsed, validated and serialized on a worker thread,
so one huge request does not stall every stream on the event loop.

Requests: `OffLoopBodyRoute` reads the body; above `ServerLimits.offload_bytes` it parses
and validates it (json + the route's pydantic model) on a worker thread and hands FastAPI
the validated model, which FastAPI then takes as it is (pydantic does not re-validate an
instance of the model). Below the threshold nothing changes: a thread hop costs more than
parsing a small body.

Answers: `json_answer` renders an answer that holds many values on a worker thread, in
pieces (lists are written a slice at a time), so the thread returns the GIL to the event
loop between pieces instead of holding it through one long C call.

What cannot move: a single C-level call holds the GIL while it runs (json's scan of one
huge string, pydantic's validation of one long list). Those stall the loop for their
duration wherever they run; everything in Python between them (our own text checks,
the model validators, a hook per parsed integer) yields at every switch interval.
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any, Callable, Coroutine, TypeVar

import anyio
from fastapi.datastructures import DefaultPlaceholder
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope

from prelude.entrypoints.openai.limits import BODY_SIZE_KEY, limits_of
from prelude.entrypoints.openai.observe import request_record

try:  # FastAPI's own OpenTelemetry data (0.13x+): a request it traces takes its handler
    from fastapi.routing import get_telemetry_data  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older FastAPI: no telemetry to keep
    def get_telemetry_data() -> None:  # type: ignore[misc]
        return None

T = TypeVar("T")

_SCALARS = (str, int, float, bool, type(None))
_SLICE = 2048  # list items serialized per C call when rendering off the loop


class _ReadBodyRequest(Request):
    """A request whose body was already read (and, above the threshold, parsed and
    validated): FastAPI's handler asks for them again and gets these."""

    def __init__(self, scope: Scope, receive: Receive, body: bytes, parsed: Any = None) -> None:
        super().__init__(scope, receive)
        self._read_body, self._parsed = body, parsed

    async def body(self) -> bytes:
        return self._read_body

    async def json(self) -> Any:
        if self._parsed is None:
            self._parsed = json.loads(self._read_body)
        return self._parsed


def _is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def _validation_error(errors: list[Any]) -> RequestValidationError:
    return RequestValidationError([{**e, "loc": ("body", *e.get("loc", ()))} for e in errors])


def _yielding_int(digits: str) -> int:
    # json's C scanner holds the GIL through a whole document; a Python-level hook per
    # integer gives the interpreter a switch point per token id, so the event loop gets
    # the GIL back every switch interval (a long id list parses slower, on this thread).
    return int(digits)


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The validated request model of a JSON body; FastAPI's own 400s for bad JSON and
    bad fields (the error handlers cannot tell which path produced them)."""
    try:
        data = json.loads(body, parse_int=_yielding_int)
    except json.JSONDecodeError as exc:
        raise _validation_error([{"type": "json_invalid", "loc": (exc.pos,), "msg": "JSON decode error",
                                  "input": {}, "ctx": {"error": exc.msg}}]) from exc
    except (RecursionError, ValueError) as exc:  # nested too deeply; an integer of over 4,300 digits
        raise _validation_error([{"type": "json_invalid", "loc": (), "msg": "JSON decode error",
                                  "input": {}, "ctx": {"error": str(exc)}}]) from exc
    return validate_body(data, model)


def validate_body(data: Any, model: type[BaseModel]) -> BaseModel:
    """The validated request model of a parsed JSON body, or FastAPI's RequestValidationError."""
    try:
        return model.model_validate(data, from_attributes=True)  # as FastAPI validates
    except ValidationError as exc:
        raise _validation_error(exc.errors(include_url=False)) from exc


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The pydantic model the route's whole JSON body is (None: no body, or not one model)."""
    field = route.body_field
    if field is None or getattr(route, "_embed_body_fields", True):
        return None
    annotation = getattr(field.field_info, "annotation", None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _direct_params(route: APIRoute) -> tuple[str, str] | None:
    """(body parameter, request parameter) of an endpoint FastAPI's handler would only
    validate the body for and call: a coroutine taking exactly the body model and the
    Request, no dependencies, annotated to return a Response (so no response model,
    status code or response class of the route's own). None: the handler does more."""
    d = route.dependant
    simple = (not (d.dependencies or d.path_params or d.query_params or d.header_params or d.cookie_params)
              and len(d.body_params) == 1 and d.request_param_name is not None
              and not (d.websocket_param_name or d.http_connection_param_name or d.response_param_name
                       or d.background_tasks_param_name or d.security_scopes_param_name)
              and inspect.iscoroutinefunction(d.call) and route.response_model is None
              and route.status_code is None and isinstance(route.response_class, DefaultPlaceholder))
    return (d.body_params[0].name, d.request_param_name) if simple else None


def _is_plain_json(request: Request) -> bool:
    """Content type application/json exactly (parameters aside): a body FastAPI parses as JSON."""
    kind = request.headers.get("content-type")
    return kind is not None and kind.split(";", 1)[0].strip().lower() == "application/json"


def _quick_parse(body: bytes, model: type[BaseModel]) -> BaseModel | None:
    """The validated model of a small JSON body, as FastAPI's handler would build it
    (json.loads, then the model validated from attributes); None when the body is not
    valid JSON or not a valid request: FastAPI's handler then writes its own 422."""
    try:
        return model.model_validate(json.loads(body), from_attributes=True)
    # JSONDecodeError and UnicodeDecodeError are ValueErrors; RecursionError: JSON nested
    # deeper than the parser goes (FastAPI's handler answers both with its 400)
    except (ValueError, ValidationError, RecursionError):
        return None


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose JSON bodies above the app's `offload_bytes` are parsed and
    validated on a worker thread (set as `app.router.route_class`).

    A small valid JSON body of an endpoint that only takes it and the Request
    (`_direct_params`) goes straight to the endpoint: FastAPI's generic handler (content
    type through email.message, dependency solving, telemetry hooks) was a large part of
    the time before a short completion reached the engine. Everything else (bad JSON, an
    invalid body, other content types, dependency overrides, FastAPI's telemetry on)
    takes FastAPI's handler, so its errors and answers stay its own."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler
        direct = _direct_params(self)
        overrides = getattr(self.dependency_overrides_provider, "dependency_overrides", None)
        endpoint = self.dependant.call

        async def route(request: Request) -> Response:
            try:
                body = await request.body()
            except ClientDisconnect:  # gone before its body arrived: a cancel, not an error
                record = request_record(request.state)
                if record is not None:
                    record.cancelled = True
                return Response(status_code=499)
            request.scope[BODY_SIZE_KEY] = len(body)  # the real size, chunked bodies included
            parsed = None
            if len(body) > limits_of(request).offload_bytes and _is_json(request):
                parsed = await anyio.to_thread.run_sync(parse_body, body, model)
            elif (direct is not None and body and not overrides and _is_plain_json(request)
                  and get_telemetry_data() is None):
                value = _quick_parse(body, model)
                if value is not None:
                    answer = await endpoint(**{direct[0]: value,
                                               direct[1]: _ReadBodyRequest(request.scope, request.receive, body)})
                    # FastAPI's handler returns a Response as it is; anything else it encodes
                    # (no response model: jsonable_encoder into its default JSONResponse).
                    return answer if isinstance(answer, Response) else JSONResponse(jsonable_encoder(answer))
            return await handler(_ReadBodyRequest(request.scope, request.receive, body, parsed))

        return route


# --- answers ---------------------------------------------------------------------------

def holds_many_values(value: Any, budget: int) -> bool:
    """Whether `value` holds more than `budget` JSON values; stops counting at the budget,
    so a small answer costs a few iterations and a large one at most `budget`."""
    left = budget
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            left -= len(item)
            stack.extend(v for v in item.values() if isinstance(v, (dict, list, tuple)))
        elif isinstance(item, (list, tuple)):
            left -= len(item)
            if left >= 0:
                stack.extend(v for v in item if isinstance(v, (dict, list, tuple)))
        if left < 0:
            return True
    return False


def _finite(value: Any) -> Any:
    """NaN and infinities as null, as FastAPI's own serializer writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a NaN somewhere
        return _dumps(_finite(value))
    except TypeError:  # not a JSON type (a model, a dataclass): as FastAPI would encode it
        return _dumps(jsonable_encoder(value))


def _render(value: Any, out: list[str]) -> None:
    """Append the JSON text of `value` to `out` in pieces: containers are walked in Python
    (a GIL switch point between pieces), lists of scalars a slice per C call."""
    if isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _render(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        if all(isinstance(v, _SCALARS) for v in value[:8]) and set(map(type, value)) <= set(_SCALARS):
            parts = (_dumps(list(value[i:i + _SLICE]))[1:-1] for i in range(0, len(value), _SLICE))
            out.append("[" + ",".join(parts) + "]")
            return
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _render(item, out)
        out.append("]")
    else:
        out.append(_dumps(value))


def render_json(value: Any) -> bytes:
    out: list[str] = []
    _render(value, out)
    return "".join(out).encode("utf-8")


async def json_answer(answer: Any, request: Request | None) -> Any:
    """`answer` as it is, unless it is a plain value holding more than the app's
    `offload_values`: then a JSON response rendered on a worker thread."""
    if isinstance(answer, Response) or not isinstance(answer, (dict, list)):
        return answer
    if not holds_many_values(answer, limits_of(request).offload_values):
        return answer
    return Response(await anyio.to_thread.run_sync(render_json, answer), media_type="application/json")


async def off_loop_if_large(http: Request | None, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` (tokenizing, chat-template rendering) on a worker thread when the
    body is large, so a big prompt does not stall every other stream on the event loop;
    small bodies stay inline (a thread hop costs more than their tokenization)."""
    if http is None:
        return fn(*args)
    size = http.scope.get(BODY_SIZE_KEY)
    if size is None:
        length = http.headers.get("content-length", "")
        size = int(length) if length.isdigit() else 0
    if size > limits_of(http).offload_bytes:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)
