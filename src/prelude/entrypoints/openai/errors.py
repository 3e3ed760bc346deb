"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the server answers has the shape `{"error": {"message", "type", "param",
"code"}}`, including FastAPI's own validation errors (422 by default, 400 here, as
OpenAI answers) and Starlette's 404/405.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prelude.engine.client import InvalidRequestError, EngineUnavailableError
from prelude.engine.errors import EngineDeadError
from prelude.engine.request import SamplingParamsError
from prelude.entrypoints.openai.protocol import UNENCODABLE_TEXT

logger = logging.getLogger("prelude.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """Raised by handlers for a client-visible error; becomes an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers


def _encodable(text: str | None) -> str | None:
    """The text with anything UTF-8 cannot hold (lone surrogates echoed from a request)
    escaped: an error body that cannot be encoded would reset the connection instead."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": _encodable(message), "type": _TYPES.get(status, "server_error"),
                      "param": _encodable(param), "code": _encodable(code)}}


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def error_body_for(exc: BaseException) -> tuple[dict[str, Any], int]:
    """The body and status for any exception: the one mapping shared by the HTTP
    handlers and the in-stream error event (headers are already sent there)."""
    if isinstance(exc, APIError):
        return error_body(exc.message, exc.status, exc.param, exc.code), exc.status
    if isinstance(exc, (SamplingParamsError, InvalidRequestError)):
        return error_body(str(exc), 400), 400
    if isinstance(exc, EngineDeadError):
        return error_body(str(exc), 503, code="engine_dead"), 503
    if isinstance(exc, EngineUnavailableError):
        return error_body(str(exc), 503, code="engine_unavailable"), 503
    return error_body(f"internal error: {type(exc).__name__}: {exc}", 500), 500


_LOCATIONS = ("body", "query", "path", "header", "cookie")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == UNENCODABLE_TEXT:
        return str(first.get("msg")), str((first.get("ctx") or {}).get("param"))
    loc = _field_path(first)
    tag = next((i for i, part in enumerate(loc) if _is_union_form(part)), None)
    if tag is not None:  # a field of several accepted forms: one error per form, named by its type
        prefix = loc[:tag]
        forms = [path[tag] for path in map(_field_path, errors) if path[:tag] == prefix and len(path) > tag]
        param = ".".join(prefix) or None
        if len(set(forms)) > 1:
            return f"{param or 'body'}: matches none of the accepted forms ({', '.join(dict.fromkeys(forms))})", param
        loc = prefix + loc[tag + 1:]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def _field_path(error: Any) -> list[str]:
    """An error's location as OpenAI names a param: without where FastAPI found it (body)."""
    loc = [str(p) for p in error.get("loc", ())]
    return loc[1:] if loc and loc[0] in _LOCATIONS else loc


def _is_union_form(part: str) -> bool:
    """Whether a location part names one form of a union (pydantic's str, list[int],
    function-after[...], a model's class name), not a field (lowercase) or an index."""
    return part in ("str", "int", "float", "bool", "none", "dict", "list") or "[" in part or part[:1].isupper()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    @app.exception_handler(SamplingParamsError)
    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineUnavailableError)
    async def _client_error(_: Request, exc: Exception) -> JSONResponse:
        body, status = error_body_for(exc)
        return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        # 413: a chunked body past the limit (middleware.BodySizeLimit), named as the refusal
        # from Content-Length is
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(message, exc.status_code, code=code)

    # Starlette sends this handler's response and then re-raises, so the ASGI server
    # logs the traceback; one short line here names the route.
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s: %r", request.method, request.url.path, exc)
        body, _ = error_body_for(exc)
        return JSONResponse(body, status_code=500)
