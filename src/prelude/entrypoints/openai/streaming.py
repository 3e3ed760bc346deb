"""Server-sent events: the response type that closes its event source when the stream
ends, the `data:` framing with in-band errors, and what `stream_options` asks for.
Shared by /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from prelude.entrypoints.openai.errors import APIError, error_body_for, logger
from prelude.entrypoints.openai.protocol import _SamplingFields
from prelude.entrypoints.openai.sampling import usage


class SSEResponse(StreamingResponse):
    """An event stream whose event iterator is closed as soon as the response ends.

    Starlette cancels the sending task when the client disconnects; if that happens
    while our generator is parked at a `yield`, nothing would close it until garbage
    collection. Closing it here runs its `finally` blocks now, which cancel the engine
    streams and so abort their requests.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        self._events = events
        self._sent_all = False  # the last event went out: the client stayed to the end
        super().__init__(self._all(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close: list[Callable[[bool], None]] = []

    async def _all(self) -> AsyncGenerator[str, None]:
        async for event in self._events:
            yield event
        self._sent_all = True

    def on_close(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(whole)` once the stream has ended, however it ended; `whole`:
        every event was sent (False: the client left, or the response was cut)."""
        self._on_close.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # runs even when the request task is cancelled
                await self._events.aclose()
            for callback in self._on_close:
                callback(self._sent_all)


def sse_stream(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[str, None]:
    """`data: {json}` events, then `data: [DONE]`.

    Headers are already sent, so an error (engine failure, late admission error)
    becomes one `data: {"error": ...}` event, which OpenAI clients raise as an error.
    """

    async def events() -> AsyncGenerator[str, None]:
        async with aclosing(chunks):  # closing us closes the chunk source, and so the engine streams
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            except Exception as exc:  # noqa: BLE001 - reported in-band
                body, status = error_body_for(exc)
                if status >= 500 and not isinstance(exc, APIError):  # an APIError is an answer (a 503 on shutdown)
                    logger.exception("stream failed")
                yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return events()


@dataclass(frozen=True)
class StreamUsage:
    """What `stream_options` asks for: a final usage chunk, and/or running usage on every chunk."""

    final: bool = False
    continuous: bool = False

    @staticmethod
    def of(req: _SamplingFields) -> StreamUsage:
        opts = req.stream_options
        if opts is None:
            return StreamUsage()
        if not req.stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")
        return StreamUsage(final=opts.include_usage, continuous=opts.include_usage and opts.continuous_usage_stats)

    def per_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The `usage` member of a content chunk: absent, null (OpenAI), or running counts (vLLM)."""
        if not self.final:
            return {}
        return {"usage": usage(prompt_tokens, completion_tokens) if self.continuous else None}
