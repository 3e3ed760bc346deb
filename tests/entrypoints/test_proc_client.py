"""ProcEngineClient against an EngineService in this process (the tiny engine), over the
real Unix-socket wire: outputs equal the engine's own, validation answers before the wire,
a drain past its timeout (fail_all) aborts in the engine, a closed HTTP side aborts its
requests, the engine's counters come over the wire."""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from prelude.engine.async_engine import AsyncEngine
from prelude.engine.client import InvalidRequestError
from prelude.engine.request import SamplingParams
from prelude.entrypoints.multiproc.engine_proc import EngineService
from prelude.entrypoints.multiproc.front_proc import _connect
from prelude.entrypoints.multiproc.proc_client import ProcEngineClient

from tests.engine.tiny import hf_tiny_llama, tiny_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


async def _until_idle(client: ProcEngineClient) -> dict[str, Any]:
    for _ in range(2000):
        state = await client.integrity()
        if state["requests_in_engine"] == 0:
            return state
        await asyncio.sleep(0.01)
    return state


def test_wire_outputs_validation_fail_all_and_close(tmp_path: Path) -> None:
    engine = tiny_engine(hf_tiny_llama(), num_blocks=256, max_model_len=256)
    reference = AsyncEngine(tiny_engine(hf_tiny_llama(), num_blocks=256, max_model_len=256))
    front = AsyncEngine(engine)
    path = str(tmp_path / "engine.sock")

    async def connect() -> ProcEngineClient:
        conn, info = await asyncio.to_thread(_connect, path)
        client = ProcEngineClient(replace(info, tokenizer=engine.tokenizer), conn)
        await client.start()
        return client

    async def main() -> None:
        service = EngineService(front, path)
        ready_r, ready_w = multiprocessing.Pipe(duplex=False)
        served = asyncio.create_task(service.run(ready_w))
        assert (await asyncio.to_thread(ready_r.recv))[0] == "ready"
        client = await connect()
        # The same increments as the engine in this process.
        got = [o async for o in client.generate("a", [1, 2, 3, 4], GREEDY)]
        want = [o async for o in reference.generate("a", [1, 2, 3, 4], GREEDY)]
        assert [(o.new_token_ids, o.text, o.finished) for o in got] == \
               [(o.new_token_ids, o.text, o.finished) for o in want]
        # Refused before the wire, with the engine's own message.
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            client.generate("long", [7] * 300, GREEDY)
        assert (await client._call("metrics"))["kv_blocks_total"] == 256
        # A drain past its timeout: the stream ends with the error and the engine drops it.
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = client.generate("cut", [5, 6, 7], long)
        await stream.__anext__()
        assert client.fail_all(RuntimeError("shutting down")) == 1
        with pytest.raises(RuntimeError, match="shutting down"):
            async for _ in stream:
                pass
        state = await _until_idle(client)
        assert state["ok"] and state["requests_in_engine"] == 0 and state["blocks_held"] == 0
        # An HTTP process that goes away: its requests are aborted in the engine.
        other = await connect()
        stream = other.generate("orphan", [8, 9], long)
        await stream.__anext__()
        other.shutdown()
        state = await _until_idle(client)
        assert state["requests_in_engine"] == 0 and state["blocks_held"] == 0
        # Finished requests are recorded; aborted ones (cut short, never finished) are not.
        await client.refresh_request_metrics()
        finished = {m.request_id: m for m in client.request_metrics()}
        assert finished["a"].output_tokens == 6 and "cut" not in finished and "orphan" not in finished
        client.shutdown()
        service.stop()
        assert await served == 0

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
        reference.shutdown()
