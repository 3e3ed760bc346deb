"""The wire between the HTTP processes and the engine process: msgspec MessagePack frames
on a Unix stream socket, one connection per HTTP process.

A round trip over an asyncio Unix socket is several times shorter than over pyzmq's ipc
transport (its I/O threads add two hops per side), and msgspec encodes and decodes a
Request in about a third of pickle's time (docs/multiproc.md). Frames are a 4-byte little-endian length, then the payload.
The engine's first frame on a new connection is the pickled ReplicaInfo (sent once).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Union

import msgspec

from prelude.engine.client import InvalidRequestError
from prelude.engine.errors import EngineDeadError
from prelude.engine.request import Request, RequestOutput

_LEN = struct.Struct("<I")


# --- HTTP process -> engine process ------------------------------------------------------


class Add(msgspec.Struct, tag="add", array_like=True):
    """Run a prepared request; its outputs come back as Outputs, a failure as Failed."""

    req: Request


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class Call(msgspec.Struct, tag="call", array_like=True):
    """Ask the engine for `method` (metrics | request_metrics | integrity); answered by Reply."""

    call_id: int
    method: str


# --- engine process -> HTTP process ------------------------------------------------------


class Outputs(msgspec.Struct, tag="out", array_like=True):
    """Increments gathered while the engine process's loop ran once (one frame, not one per request)."""

    items: list[RequestOutput]


class Failed(msgspec.Struct, tag="fail", array_like=True):
    """A request ended with an error; `kind` picks the exception the HTTP side raises."""

    request_id: str
    kind: str  # dead | invalid | error
    message: str


class Reply(msgspec.Struct, tag="reply", array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


ToEngine = Union[Add, Abort, Call]
ToFront = Union[Outputs, Failed, Reply]


class EngineStepError(RuntimeError):
    """The engine failed this request (a failed step, or a bad request it refused late): HTTP 500."""


def failure(request_id: str, exc: BaseException) -> Failed:
    kind = "dead" if isinstance(exc, EngineDeadError) else "invalid" if isinstance(exc, InvalidRequestError) else "error"
    message = str(exc) if kind != "error" else f"{type(exc).__name__}: {exc}"
    return Failed(request_id, kind, message)


def exception_of(failed: Failed) -> BaseException:
    if failed.kind == "dead":
        return EngineDeadError(failed.message)
    if failed.kind == "invalid":
        return InvalidRequestError(failed.message)
    return EngineStepError(failed.message)


class Codec:
    """One side's encoder and decoder (msgspec's are reusable and not thread-bound)."""

    def __init__(self, incoming: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def frame(self, message: msgspec.Struct) -> bytes:
        payload = self._encoder.encode(message)
        return _LEN.pack(len(payload)) + payload

    def decode(self, payload: bytes) -> Any:
        return self._decoder.decode(payload)


def raw_frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's payload; IncompleteReadError at the peer's end."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return await reader.readexactly(n)


def read_frame_blocking(sock: Any) -> bytes:
    """The next frame from a blocking socket (the handshake, before any event loop runs)."""

    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the engine process closed the connection")
            buf += chunk
        return bytes(buf)

    (n,) = _LEN.unpack(exactly(_LEN.size))
    return exactly(n)
