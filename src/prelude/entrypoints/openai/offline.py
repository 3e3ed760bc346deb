"""One request body answered without HTTP: the batch runner's way into the routes.

The body goes through what the HTTP route does to it (pydantic validation, the model
name, unknown fields, the route's handler, the same error bodies), so a batch line's
`response.body` is what the server would have answered for that body."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from prelude.engine.client import EngineClient
from prelude.entrypoints.openai.disconnect import StaysConnected
from prelude.entrypoints.openai.errors import APIError, error_body, error_body_for, validation_message
from prelude.entrypoints.openai.fields import check_unknown_fields
from prelude.entrypoints.openai.limits import BODY_SIZE_KEY, ServerLimits
from prelude.entrypoints.openai.offload import render_json, validate_body
from prelude.entrypoints.openai.lora_adapters import ServedAdapters
from prelude.entrypoints.openai.request_gate import GatedEngine, RequestGate
from prelude.entrypoints.openai.routes import ROUTES

logger = logging.getLogger("prelude.batch")


class _State:
    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits


class _App:
    def __init__(self, limits: ServerLimits) -> None:
        self.state = _State(limits)


class OfflineRequest(StaysConnected):
    """What the handlers read from an HTTP request, for a body that came from a batch
    line: the limits, the body's size (large ones are tokenized off the event loop), and
    a client that never disconnects (nothing polls it)."""

    headers: dict[str, str] = {}

    def __init__(self, limits: ServerLimits, body_bytes: int) -> None:
        self.app = _App(limits)
        self.scope = {BODY_SIZE_KEY: body_bytes}

    async def is_disconnected(self) -> bool:
        return False


async def answer(engine: EngineClient, url: str, body: Any, limits: ServerLimits, body_bytes: int = 0,
                 adapters: ServedAdapters | None = None) -> tuple[int, bytes]:
    """(status, JSON body) of POST `url` with `body` (parsed JSON), as the server answers it.
    `adapters`: the LoRA adapters a body's `model` may name (None: the base model only)."""
    route = ROUTES.get(url)
    if route is None:
        known = ", ".join(sorted(u for u in ROUTES if u.startswith("/v1/")))
        return 404, render_json(error_body(f"unknown url {url!r}; a batch line may name {known}", 404,
                                           param="url", code="unknown_url"))
    try:
        limits.check_body(body_bytes)  # a batch line: the body with its custom_id, url and method
        req = validate_body(body, route.body)
        if getattr(req, "stream", False):
            raise APIError("stream is not supported in a batch: each line gets one whole answer", param="stream")
        name = req.model  # type: ignore[attr-defined]
        lora = (adapters or ServedAdapters(engine)).resolve(name)  # the server's 404 for another name
        check_unknown_fields(req, url)
        # The route's engine view (adapter, request timeout), on a gate of its own: batch
        # lines are not the interactive traffic the server's gate counts.
        ticket = RequestGate().enter()
        try:
            gated = GatedEngine(engine, ticket, limits.request_timeout_s, None, lora)
            result = await route.handler(req)(gated, req, OfflineRequest(limits, body_bytes))
        finally:
            ticket.close()
    except RequestValidationError as exc:
        message, param = validation_message(exc)
        return 400, render_json(error_body(message, 400, param))
    except Exception as exc:  # noqa: BLE001 - every failure becomes the line's error answer
        err, status = error_body_for(exc)
        if status >= 500:
            logger.error("%s failed: %r", url, exc)
        return status, render_json(err)
    if isinstance(result, Response):
        return result.status_code, bytes(result.body)
    return 200, render_json(result)
