"""Per-request bounds of the HTTP server: what one request may ask for, so that a single
client can not take the process's memory (bodies, prompts x n, batch inputs, time)."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request as HTTPRequest

from prelude.entrypoints.openai.errors import APIError

BODY_SIZE_KEY = "prelude.body_bytes"  # ASGI scope key: the request body's size as read


@dataclass(frozen=True)
class ServerLimits:
    max_waiting_requests: int | None = None  # past it: 429 (None: unbounded)
    max_body_bytes: int = 32 * 2**20  # 413 above
    max_request_tokens: int = 262_144  # prompt tokens x n over all prompts of one request (400 above)
    max_batch_inputs: int = 2048  # prompts / inputs / documents of one request (400 above)
    request_timeout_s: float | None = None  # past it the request is aborted (408)
    shutdown_timeout_s: float = 30.0  # graceful drain: in-flight requests get this long to finish
    offload_bytes: int = 64 * 1024  # bodies above this are parsed, validated, tokenized off the event loop
    offload_values: int = 20_000  # answers holding more JSON values than this are serialized off it

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be at least 0")
        if self.max_body_bytes < 1 or self.max_request_tokens < 1 or self.max_batch_inputs < 1:
            raise ValueError("limits must be positive")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")

    def check_body(self, size: int) -> None:
        """A body (a batch line) of `size` bytes, 413 past max_body_bytes (the HTTP server
        refuses it in middleware.BodySizeLimit before any route runs)."""
        if size > self.max_body_bytes:
            raise APIError(body_too_large(self.max_body_bytes), 413, code="request_too_large")

    def check_inputs(self, count: int, param: str) -> None:
        if count > self.max_batch_inputs:
            raise APIError(f"{param}: {count} inputs in one request; this server takes at most "
                           f"{self.max_batch_inputs} (--max-batch-inputs)", param=param, code="too_many_inputs")

    def check_tokens(self, prompt_lengths: list[int], n: int = 1, param: str = "prompt") -> None:
        """Prompt tokens x n over the request, the memory it can pin at once."""
        total = sum(prompt_lengths) * n
        if total > self.max_request_tokens:
            raise APIError(
                f"the request holds {total} prompt tokens (x n = {n}); this server takes at most "
                f"{self.max_request_tokens} per request (--max-request-tokens)", param=param,
                code="request_too_large",
            )


def body_too_large(max_bytes: int) -> str:
    return f"the request body is larger than the server's limit of {max_bytes} bytes"


def limits_of(http: HTTPRequest | None) -> ServerLimits:
    """The app's limits (defaults when a handler runs outside build_app, e.g. in a unit test)."""
    state = getattr(getattr(http, "app", None), "state", None)
    return getattr(state, "limits", None) or ServerLimits()
