"""bench/raw_http.py, the overhead benchmark's lean HTTP client, against a real socket
server (asyncio) that answers with canned HTTP/1.1 bytes."""

import asyncio
import json

import pytest

from prelude.bench.loadgen import LoadSpec, run_load
from prelude.bench.raw_http import RawPool, raw_completion_sender, raw_json_sender


def _sse(events: list[dict], done: bool = True) -> bytes:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if done else "")
    return body.encode()


def _chunked(parts: list[bytes]) -> bytes:
    out = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts if p)
    return out + b"0\r\n\r\n"


class CannedServer:
    """Reads each request (head + Content-Length body) and answers from `reply(body)`:
    raw response bytes, or (bytes, "close") to close the connection after them."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.connections = 0
        self.bodies: list[dict] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = json.loads(await reader.readexactly(length))
                self.bodies.append(body)
                answer = self.reply(body)
                close = isinstance(answer, tuple)
                writer.write(answer[0] if close else answer)
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


async def _serve(server: CannedServer, work) -> object:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        return await work(f"http://127.0.0.1:{port}")
    finally:
        srv.close()
        await srv.wait_closed()


def _json_answer(status: int, obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def test_json_requests_reuse_one_connection_per_slot_and_count_failures() -> None:
    def reply(body: dict) -> bytes:
        return _json_answer(500 if body["input"] == "bad" else 200, {"data": [1]})

    server = CannedServer(reply)

    async def work(base: str):
        send = raw_json_sender("/v1/embeddings", lambda p: {"input": p}, lambda _: 3)
        return await run_load(send, ["a", "b", "bad", "c", "d", "e"], LoadSpec(2, warmup=0), client=RawPool(base))

    result = asyncio.run(_serve(server, work))
    oks = [r for r in result.records if r.ok]
    assert len(result.records) == 6 and len(oks) == 5 and all(r.items == 3 for r in oks)
    assert "HTTP 500" in next(r.error for r in result.records if not r.ok)
    assert server.connections == 2  # one keep-alive connection per request in flight
    assert sorted(b["input"] for b in server.bodies) == ["a", "b", "bad", "c", "d", "e"]


@pytest.mark.parametrize("split", [1, 7, 1000])  # events cut across chunk boundaries, or whole
def test_a_chunked_event_stream_counts_tokens_and_ttft(split: int) -> None:
    events = [{"choices": [{"text": t}]} for t in ("x", "y", "z")] + [{"choices": [], "usage": {"completion_tokens": 3}}]
    stream = _sse(events)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    answer = head + _chunked([stream[i : i + split] for i in range(0, len(stream), split)])
    server = CannedServer(lambda body: answer)

    async def work(base: str):
        return await run_load(raw_completion_sender("m", 3), ["p1", "p2", "p3"], LoadSpec(1, warmup=0),
                              client=RawPool(base))

    result = asyncio.run(_serve(server, work))
    assert all(r.ok and r.output_tokens == 3 and r.chunks == 3 for r in result.records)
    assert all(0 < r.ttft_s <= r.e2e_s for r in result.records)
    assert server.connections == 1 and all(b["stream"] and b["model"] == "m" for b in server.bodies)


def test_a_cut_stream_fails_and_the_next_request_reconnects() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    whole = head + _chunked([_sse([{"choices": [{"text": "x"}]}])])

    def reply(body: dict):
        if body["prompt"] == "cut":  # a chunk announced, then the connection closes
            return head + f"{100:x}\r\n".encode() + b"data: {}", "close"
        if body["prompt"] == "no-done":
            return head + _chunked([_sse([{"choices": [{"text": "x"}]}], done=False)])
        return whole

    server = CannedServer(reply)

    async def work(base: str):
        pool = RawPool(base)
        send = raw_completion_sender(None, 1)
        async with pool:
            return [await send(pool, p) for p in ("ok", "cut", "ok", "no-done", "ok")]

    records = asyncio.run(_serve(server, work))
    assert [r.ok for r in records] == [True, False, True, False, True]
    assert "cut" in records[1].error and "stream ended before [DONE]" in records[3].error
    assert server.connections == 2  # the cut connection was replaced, the others kept


def test_a_server_closing_after_its_answer_is_reconnected_to() -> None:
    body = json.dumps({"ok": True}).encode()
    answer = (f"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    server = CannedServer(lambda b: (answer, "close"))

    async def work(base: str):
        pool = RawPool(base)
        send = raw_json_sender("/v1/classify", lambda p: {"input": p}, lambda _: 1)
        async with pool:
            return [await send(pool, p) for p in ("a", "b", "c")]

    records = asyncio.run(_serve(server, work))
    assert all(r.ok for r in records) and server.connections == 3


def test_the_pool_refuses_what_it_cannot_speak() -> None:
    with pytest.raises(ValueError, match="plain http"):
        RawPool("https://example.org")


@pytest.mark.parametrize("kind", ["raw", "httpx"])
def test_the_load_client_reads_the_same_stream_with_either_kind(kind: str) -> None:
    from prelude.bench.load_clients import LoadClient

    events = [{"choices": [{"text": t}]} for t in ("x", "y")] + [{"choices": [], "usage": {"completion_tokens": 2}}]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    server = CannedServer(lambda body: head + _chunked([_sse(events)]))

    async def work(base: str):
        client = LoadClient(kind)
        send, pool = client.completions(base, "m", 2), client.pool(base)
        assert (pool is None) == (kind == "httpx")
        return await run_load(send, ["p1", "p2"], LoadSpec(1, warmup=0), client=pool)

    result = asyncio.run(_serve(server, work))
    assert all(r.ok and r.output_tokens == 2 and r.chunks == 2 for r in result.records)
    assert [b["prompt"] for b in server.bodies] == ["p1", "p2"] and all(b["max_tokens"] == 2 for b in server.bodies)
