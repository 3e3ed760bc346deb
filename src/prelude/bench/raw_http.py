"""A lean HTTP/1.1 client for `prelude bench overhead`'s load generator.

httpx's per-request cost (request building, header models, its connection pool's state
machine) is high enough that at c=32-64 the load generator holds a whole core of a 2-core
machine, about as much as the server it measures, and every peer loses that core to it. This client keeps one keep-alive connection per in-flight
request (asyncio streams), writes a prepared request in one write and parses only what a
loopback benchmark needs: the status, Content-Length or chunked bodies, `Connection:
close`. Loopback benchmarks only: no TLS, proxies, redirects or compression.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

from prelude.bench.loadgen import Record, StreamTally


class RawHTTPError(Exception):
    """The server closed the connection or answered what this client cannot parse."""


class RawConnection:
    """One keep-alive connection: requests one after another."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
        self._close_after = False
        self.mid_response = False  # a response not read to its end: the connection is not reusable

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def start(self, path: str, body: bytes) -> tuple[int, bool, int | None]:
        """Send a POST; (status, chunked, content length) once the response head is read."""
        reader, writer = await self._open()
        self.mid_response = True
        writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\n" + self._head
                     + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.close()
            raise RawHTTPError(f"connection closed before the response: {exc}") from exc
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            self.close()
            raise RawHTTPError(f"not an HTTP response: {lines[0][:80]!r}")
        chunked, length, close = False, None, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value
            elif name == "connection":
                close = value == "close"
        self._close_after = close
        return int(parts[1]), chunked, length

    async def body_parts(self, chunked: bool, length: int | None) -> AsyncIterator[bytes]:
        """The response body as it arrives (a chunk at a time when chunked)."""
        reader = self._reader
        assert reader is not None
        try:
            if chunked:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif length is not None:
                if length:
                    yield await reader.readexactly(length)
            else:  # no length: the body runs to the end of the connection
                yield await reader.read()
                self._close_after = True
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            self.close()
            raise RawHTTPError(f"response body cut: {exc}") from exc
        self.mid_response = False
        if self._close_after:
            self.close()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        status, chunked, length = await self.start(path, body)
        return status, b"".join([part async for part in self.body_parts(chunked, length)])


class RawPool:
    """Connections for a closed loop: one per request in flight, reused."""

    def __init__(self, base: str) -> None:
        url = urlsplit(base)
        if url.scheme != "http" or url.hostname is None:
            raise ValueError(f"raw_http serves plain http://host:port bases, not {base!r}")
        self.host, self.port = url.hostname, url.port or 80
        self._idle: list[RawConnection] = []

    def take(self) -> RawConnection:
        return self._idle.pop() if self._idle else RawConnection(self.host, self.port)

    def give(self, conn: RawConnection) -> None:
        if conn.mid_response:  # left mid-body (a failure): the next request must not read its rest
            conn.close()
            conn.mid_response = False
        self._idle.append(conn)

    async def __aenter__(self) -> RawPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def _failed(t0: float, why: str) -> Record:
    return Record(False, time.perf_counter() - t0, 0.0, error=why[:200])


def raw_json_sender(path: str, body_of: Callable[[Any], dict[str, Any]],
                    items_of: Callable[[Any], int]) -> Callable[[RawPool, Any], Any]:
    """loadgen.json_sender over a RawPool: a non-streaming JSON POST; TTFT = E2E."""

    async def send(pool: RawPool, payload: Any) -> Record:
        body = json.dumps(body_of(payload)).encode()
        conn = pool.take()
        t0 = time.perf_counter()
        try:
            status, data = await conn.post(path, body)
        except (RawHTTPError, OSError) as exc:
            return _failed(t0, f"{type(exc).__name__}: {exc}")
        finally:
            pool.give(conn)
        dt = time.perf_counter() - t0
        if status != 200:
            return Record(False, dt, 0.0, error=f"HTTP {status}: {data[:200].decode(errors='replace')}")
        return Record(True, dt, dt, items=items_of(payload))

    return send


def raw_completion_sender(model: str | None, max_tokens: int) -> Callable[[RawPool, Any], Any]:
    """loadgen.completion_sender over a RawPool: streams /v1/completions; TTFT is the
    first event carrying text; a stream without `data: [DONE]` is a failure."""

    async def send(pool: RawPool, prompt: str) -> Record:
        req: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                               "ignore_eos": True, "stream_options": {"include_usage": True}}
        if model:
            req["model"] = model
        body = json.dumps(req).encode()
        conn = pool.take()
        tally, pending = StreamTally(time.perf_counter()), b""
        try:
            status, chunked, length = await conn.start("/v1/completions", body)
            if status != 200:
                data = b"".join([p async for p in conn.body_parts(chunked, length)])
                return Record(False, time.perf_counter() - tally.t0, 0.0,
                              error=f"HTTP {status}: {data[:200].decode(errors='replace')}")
            async for part in conn.body_parts(chunked, length):
                pending += part
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    error = tally.line(line.decode())
                    if error is not None:
                        return Record(False, time.perf_counter() - tally.t0, 0.0, error=error)
        except (RawHTTPError, OSError, ValueError) as exc:
            return _failed(tally.t0, f"{type(exc).__name__}: {exc}")
        finally:
            pool.give(conn)
        return tally.record()

    return send
