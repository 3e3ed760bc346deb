"""Streaming increments held for the next step's heads (AsyncEngine._iteration): on a model
whose LM head outweighs its trunk, every token still arrives, in order, and closing a
stream still aborts its request."""

from __future__ import annotations

from typing import Any

import pytest

from prelude import SamplingParams
from prelude.engine.async_engine import AsyncEngine

from tests.engine.test_async_engine import close_streams_after, streams_at_once, streams_one_by_one
from tests.engine.tiny import hf_tiny_llama, tiny_engine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def wide_head():  # noqa: ANN201
    """Hidden 64, 16,448 tokens: the head is ~14x the trunk a row, as the free model's is ~20x."""
    return hf_tiny_llama(seed=5, vocab_size=16_448)


def _holds(engine: Any) -> list[int]:
    """Count the steps that were handed held outputs to release in their heads."""
    real, handed = engine.step, [0]

    def step(on_heads: Any = None) -> Any:
        handed[0] += on_heads is not None
        return real(on_heads) if on_heads is not None else real()

    engine.step = step
    return handed


async def _collect(front: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in front.generate(rid, prompt, params):
        assert len(out.new_token_ids) == 1 and out.num_output_tokens == len(tokens) + 1  # one at a time, in order
        tokens.extend(out.new_token_ids)
    return tokens


def test_which_steps_count_as_heads_heavy(wide_head: Any) -> None:
    wide = tiny_engine(wide_head).runner
    narrow = tiny_engine(hf_tiny_llama(seed=5)).runner  # 260 tokens: the trunk outweighs the head
    assert wide.heads_outweigh_trunk(tokens=8, sampled=8)
    assert not wide.heads_outweigh_trunk(tokens=8 * 200, sampled=8)  # a long prefill's trunk
    assert not narrow.heads_outweigh_trunk(tokens=8, sampled=8)
    assert not wide.heads_outweigh_trunk(tokens=8, sampled=0)


def test_held_streams_match_sequential(wide_head: Any) -> None:
    engine = tiny_engine(wide_head)
    handed = _holds(engine)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[10 + i, 20, 30 + i] for i in range(6)]
    front = AsyncEngine(engine)
    concurrent = streams_at_once(front, prompts, params, _collect)
    held = handed[0]
    alone = streams_one_by_one(front, prompts, params, _collect)
    front.shutdown()
    assert held > 0  # increments were held and handed over in a later step's heads
    assert concurrent == alone and all(len(t) == 10 for t in concurrent)
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_closing_a_held_stream_aborts_and_frees(wide_head: Any) -> None:
    engine = tiny_engine(wide_head)
    handed = _holds(engine)
    front = AsyncEngine(engine)
    # past the first token: the later increments are the held kind
    close_streams_after(front, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True), outputs=3)
    assert handed[0] > 0 and not engine.has_unfinished()
    front.shutdown()
    assert not [m.request_id for m in engine.finished_metrics]  # aborted, none ran to its end
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks
