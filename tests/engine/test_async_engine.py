"""The async front: many concurrent streams over one engine thread; early close aborts."""

from __future__ import annotations

import asyncio

import pytest

from prelude import SamplingParams
from prelude.engine.async_engine import AsyncEngine
from prelude.engine.client import InvalidRequestError

from tests.engine.tiny import hf_tiny_llama, tiny_engine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    return hf_tiny_llama()


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, prompt, params):
        tokens.extend(out.new_token_ids)
    return tokens


def test_concurrent_streams_match_sequential(hf_model) -> None:  # noqa: ANN001
    engine = tiny_engine(hf_model)
    front = AsyncEngine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[10 + i, 20, 30 + i] for i in range(8)]

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(_collect(front, f"r{i}", p, params) for i, p in enumerate(prompts)))

    together = asyncio.run(run())
    alone = [asyncio.run(_collect(front, f"s{i}", p, params)) for i, p in enumerate(prompts)]
    front.shutdown()
    assert together == alone and all(len(t) == 8 for t in together)
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_closing_a_stream_aborts_and_frees(hf_model) -> None:  # noqa: ANN001
    """Fails with a no-op `LLMEngine.abort`: the generations are long (ignore_eos, 400
    tokens), so without the abort they would run to the end and be recorded as finished;
    with it none of them finishes and every block is back."""
    engine = tiny_engine(hf_model)
    front = AsyncEngine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run() -> None:
        streams = [front.generate(f"a{i}", [1, 2, 3, i], params) for i in range(4)]
        for s in streams:
            await s.__anext__()
        for s in streams:
            await s.aclose()
        for _ in range(3000):  # the engine thread applies the aborts at its next step
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert not engine.has_unfinished()
    front.shutdown()
    assert not [m.request_id for m in engine.finished_metrics]  # aborted, none ran to its end
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_admission_error_surfaces_before_first_output(hf_model) -> None:  # noqa: ANN001
    front = AsyncEngine(tiny_engine(hf_model, max_model_len=16))

    async def run() -> None:
        with pytest.raises(InvalidRequestError):
            await front.generate("big", list(range(20)), SamplingParams()).__anext__()

    asyncio.run(run())
    assert front.is_healthy()
    front.shutdown()
