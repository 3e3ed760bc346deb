"""Plain ASGI middlewares: bearer auth, the body-size cap.

Plain ASGI rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware re-pipes
every streamed chunk through a memory stream and an extra task, which costs per token and
muddles disconnect handling.
"""

from __future__ import annotations

import secrets

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prelude.entrypoints.openai.errors import error_response
from prelude.entrypoints.openai.limits import body_too_large


class BearerAuth:
    """`Authorization: Bearer <key>` on every path except `open_paths` (default deny, so a
    route added later is closed unless someone opens it on purpose). The comparison takes
    constant time (`secrets.compare_digest`)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._open = open_paths

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        # the scheme's case is free (RFC 9110 11.1: "bearer" is "Bearer")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.lstrip(b" "), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open and not self._authorized(scope):
            response = error_response("invalid or missing API key", 401, code="invalid_api_key")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """413 for a body over `max_bytes`: refused from Content-Length before reading, or,
    for a body sent without a length (chunked), as soon as the bytes read pass the limit
    (an HTTPException, which FastAPI's body reader lets through to the error handlers)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return body_too_large(self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._message(), 413, code="request_too_large")(scope, receive, send)
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted_receive, send)
