"""OpenAI-style error bodies and the exception handlers that produce them."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prelude.engine.client import AdmissionError
from prelude.engine.request import SamplingParamsError

logger = logging.getLogger("prelude.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(SamplingParamsError)
    @app.exception_handler(AdmissionError)
    async def _bad_params(_: Request, exc: Exception) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(message, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)
