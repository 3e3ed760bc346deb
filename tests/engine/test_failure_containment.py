"""Failure containment: a forward that raises fails only its step's requests and leaks no
block; the engine thread never dies silently; prompt logprobs are computed in chunks."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from prelude import SamplingParams
from prelude.engine.async_engine import AsyncEngine, EngineStepError
from prelude.forward_batch import MixedBatch, OneShotBatch
from prelude.engine.errors import EngineDeadError, StepFailed
from prelude.engine.request import PoolingParams, PoolingTask
from prelude.model.layers import heads

from tests.engine.tiny import hf_tiny_llama, tiny_engine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    return hf_tiny_llama()


class _Boom(RuntimeError):
    pass


def _fail_oneshot_steps(engine: Any, times: int = 1) -> list[int]:
    """Make the next `times` OneShot forwards raise, as an out-of-memory would."""
    real = engine.runner.launch
    left = [times]

    def launch(batch: Any, *rest: Any) -> Any:
        if isinstance(batch, OneShotBatch) and left[0] > 0:
            left[0] -= 1
            raise _Boom("simulated out of memory")
        return real(batch, *rest)

    engine.runner.launch = launch
    return left


def test_failed_oneshot_step_releases_its_held_blocks(hf_model: Any) -> None:
    """Default config (prefix cache on): the step holds prefix and publish blocks; a
    raising forward must give them back, publish nothing, and forget the requests."""
    engine = tiny_engine(hf_model, num_blocks=128)
    shared = list(range(40, 72))  # 8 full blocks, cached by the first request
    engine.add_request("warm", shared + [1, 2], SamplingParams(max_tokens=0, prompt_logprobs=0))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.prefix is not None and engine.kv.prefix.num_cached_blocks > 0
    _fail_oneshot_steps(engine, times=100)
    for i in range(4):  # prefix hits (held for the step) plus new full blocks to publish
        engine.add_request(f"p{i}", shared + list(range(100 + 10 * i, 110 + 10 * i)),
                           SamplingParams(max_tokens=0, prompt_logprobs=1))
    failed: list[str] = []
    while engine.has_unfinished():
        try:
            outputs = engine.step()  # may launch nothing: a burst of OneShot arrivals is gathered first
        except StepFailed as step_failed:
            assert isinstance(step_failed.cause, _Boom)
            failed += step_failed.request_ids
        else:
            assert outputs == []
        engine.check_integrity()
    assert sorted(failed) == ["p0", "p1", "p2", "p3"]
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks  # nothing leaked
    # ... and the engine still serves the same prompts.
    engine.runner.launch = type(engine.runner).launch.__get__(engine.runner)
    engine.add_request("after", shared + [7, 8, 9], SamplingParams(max_tokens=0, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].prompt_logprobs is not None
    engine.check_integrity()


def test_failed_decode_step_frees_the_tables_of_its_requests(hf_model: Any) -> None:
    engine = tiny_engine(hf_model, num_blocks=64)
    for i in range(3):
        engine.add_request(f"d{i}", [5, 6, 7, i], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    real = engine.runner.launch

    class _FailsOnWait:  # a device error surfaces when the result is awaited
        heads_heavy = False

        def wait(self) -> Any:
            raise _Boom("kernel error")

    engine.runner.launch = lambda batch, *rest: _FailsOnWait()
    with pytest.raises(StepFailed) as failed:
        engine.step()
    engine.runner.launch = real
    assert sorted(failed.value.request_ids) == ["d0", "d1", "d2"]
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


async def _tokens(front: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams,
                  started: asyncio.Event | None = None) -> list[int]:
    out: list[int] = []
    async for o in front.generate(rid, prompt, params):
        out.extend(o.new_token_ids)
        if started is not None:
            started.set()
    return out


def test_async_front_fails_only_the_requests_of_the_failed_step(hf_model: Any) -> None:
    engine = tiny_engine(hf_model, fuse_oneshot=False)  # OneShot rows in steps of their own
    front = AsyncEngine(engine)
    _fail_oneshot_steps(engine)
    decode = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run() -> tuple[Any, Any]:
        started = asyncio.Event()
        chat = asyncio.create_task(_tokens(front, "decode", [1, 2, 3], decode, started))
        await started.wait()  # the decode is running (its first token is out) when the OneShot step fails
        judged = await asyncio.gather(
            front.encode("embed", [9, 8, 7, 6], PoolingParams(PoolingTask.EMBED)), return_exceptions=True)
        return await chat, judged[0]

    tokens, judged = asyncio.run(asyncio.wait_for(run(), 30))
    assert isinstance(judged, EngineStepError)
    assert len(tokens) == 24  # the decode next to it finished untouched
    assert front.is_healthy()
    front.shutdown()
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_failed_fused_step_fails_its_decode_and_oneshot_rows_and_leaks_nothing(hf_model: Any) -> None:
    """A fused step that raises fails every request in it (the decodes riding with the
    OneShot rows too: one forward), releases their blocks and the OneShot rows' holds."""
    engine = tiny_engine(hf_model)
    front = AsyncEngine(engine)
    real = engine.runner.launch
    left = [1]

    def launch(batch: Any, *rest: Any) -> Any:
        if isinstance(batch, MixedBatch) and batch.oneshot_rows and left[0] > 0:
            left[0] -= 1
            raise _Boom("simulated out of memory")
        return real(batch, *rest)

    engine.runner.launch = launch  # type: ignore[method-assign]
    decode = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # Long enough to be still decoding when the OneShot request arrives, on any machine.
    long_decode = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run() -> list[Any]:
        decoding = asyncio.Event()

        async def chat() -> list[int]:
            out: list[int] = []
            async for o in front.generate("decode", list(range(1, 30)), long_decode):
                out.extend(o.new_token_ids)
                decoding.set()
            return out

        chat_task = asyncio.create_task(chat())
        await decoding.wait()  # the decode is running when the fused step fails
        embed = front.encode("embed", list(range(40, 72)), PoolingParams(PoolingTask.EMBED))
        return await asyncio.gather(chat_task, embed, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(run(), 30))
    assert left[0] == 0 and all(isinstance(r, EngineStepError) for r in results), results
    assert front.is_healthy()
    after = asyncio.run(asyncio.wait_for(_tokens(front, "after", [1, 2, 3], decode), 30))
    assert len(after) == 24
    front.shutdown()
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_engine_thread_survives_a_failing_abort(hf_model: Any) -> None:
    """`abort` raising inside the inbox drain used to kill the thread: every waiting
    handler then hung forever. Now the handlers get an error and the loop goes on."""
    engine = tiny_engine(hf_model)
    front = AsyncEngine(engine)
    real_abort = engine.abort
    calls = [0]

    def abort_once(rid: str) -> bool:
        calls[0] += 1
        if calls[0] == 1:
            raise _Boom("abort exploded")
        return real_abort(rid)

    engine.abort = abort_once  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def run() -> Any:
        waiting = asyncio.create_task(_tokens(front, "waiter", [4, 5, 6], params))
        dropped = front.generate("dropped", [1, 2, 3], params)
        await dropped.__anext__()
        await dropped.aclose()  # queues an abort, which raises on the engine thread
        return await asyncio.gather(waiting, return_exceptions=True)

    (result,) = asyncio.run(asyncio.wait_for(run(), 30))  # a hang fails here
    assert isinstance(result, EngineStepError)
    assert front.is_healthy()

    async def again() -> list[int]:
        return await _tokens(front, "again", [7, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))

    assert len(asyncio.run(asyncio.wait_for(again(), 30))) == 3
    front.shutdown()
    engine.check_integrity()


def test_a_dead_engine_loop_fails_waiters_and_turns_unhealthy(hf_model: Any) -> None:
    engine = tiny_engine(hf_model)
    front = AsyncEngine(engine)

    def broken(*_: Any) -> Any:
        raise _Boom("scheduler state corrupted")

    engine.scheduler.schedule = broken  # type: ignore[method-assign]
    engine.abort_all = broken  # type: ignore[method-assign]

    async def run() -> Any:
        return await asyncio.gather(_tokens(front, "w", [1, 2], SamplingParams(max_tokens=5)), return_exceptions=True)

    (result,) = asyncio.run(asyncio.wait_for(run(), 30))
    assert isinstance(result, (EngineStepError, EngineDeadError))
    async def poke(i: int) -> None:
        await asyncio.gather(_tokens(front, f"x{i}", [1], SamplingParams(max_tokens=2)), return_exceptions=True)

    for i in range(100):  # the loop keeps failing, and gives up after a few tries
        if not front.is_healthy():
            break
        asyncio.run(asyncio.wait_for(poke(i), 10))
    assert not front.is_healthy()

    async def late() -> None:
        with pytest.raises(EngineDeadError):
            await _tokens(front, "late", [1, 2], SamplingParams(max_tokens=2))

    asyncio.run(asyncio.wait_for(late(), 10))
    front.shutdown()


def test_prompt_logprobs_are_projected_in_chunks() -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(37, 8), torch.randn(50, 8)
    tokens = torch.randint(0, 50, (38,)).tolist()
    rows_seen: list[int] = []

    def logits(h: torch.Tensor) -> torch.Tensor:
        rows_seen.append(h.shape[0])
        return h @ weight.T

    whole = heads.prompt_token_logprobs(logits, hidden, tokens, 3, chunk=1000)
    chunked = heads.prompt_token_logprobs(logits, hidden, tokens, 3, chunk=8)
    assert max(rows_seen[1:]) == 8 and len(rows_seen) == 1 + 5  # [n, V] never built at once
    for a, b in zip(whole, chunked, strict=True):
        assert a is not None and b is not None and torch.allclose(a.float(), b.float())
    ref = torch.log_softmax(hidden @ weight.T, -1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(chunked[0], ref, atol=1e-5)
