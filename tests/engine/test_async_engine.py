"""The async front: many concurrent streams over one engine thread; early close aborts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from prelude import SamplingParams
from prelude.engine.async_engine import NAP_S, AsyncEngine
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


def streams_at_once(front: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                    collect: Callable[..., Awaitable[list[int]]] = _collect) -> list[list[int]]:
    """Each prompt's tokens, all streams at once (request ids r0, r1, ...)."""
    async def together() -> list[list[int]]:
        return await asyncio.gather(*(collect(front, f"r{i}", p, params) for i, p in enumerate(prompts)))

    return asyncio.run(together())


def streams_one_by_one(front: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                       collect: Callable[..., Awaitable[list[int]]] = _collect) -> list[list[int]]:
    """Each prompt's tokens, one stream after another (request ids s0, s1, ...)."""
    return [asyncio.run(collect(front, f"s{i}", p, params)) for i, p in enumerate(prompts)]


def close_streams_after(front: AsyncEngine, params: SamplingParams, outputs: int) -> None:
    """Four streams read `outputs` increments each, then closed; returns once the engine
    thread has applied the aborts (or after ~30 s)."""
    async def run() -> None:
        streams = [front.generate(f"a{i}", [1, 2, 3, i], params) for i in range(4)]
        for s in streams:
            for _ in range(outputs):
                await s.__anext__()
        for s in streams:
            await s.aclose()
        for _ in range(3000):  # the engine thread applies the aborts at its next step
            if not front.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())


def test_concurrent_streams_match_sequential(hf_model) -> None:  # noqa: ANN001
    engine = tiny_engine(hf_model)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    front = AsyncEngine(engine)
    prompts = [[10 + i, 20, 30 + i] for i in range(8)]
    together, alone = streams_at_once(front, prompts, params), streams_one_by_one(front, prompts, params)
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
    close_streams_after(front, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), outputs=1)
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


def test_while_building_runs_on_the_calling_thread_beside_the_build(hf_model) -> None:  # noqa: ANN001
    """The server imports its modules while the engine builds: `while_building` runs on the
    constructor's thread before the build is awaited (the factory here cannot finish until it
    has run), and the front serves as usual after."""
    import threading

    ran_on: list[threading.Thread] = []
    gone = threading.Event()

    def factory():  # noqa: ANN202
        assert gone.wait(timeout=30), "while_building did not run beside the build"
        return tiny_engine(hf_model)

    def beside() -> None:
        ran_on.append(threading.current_thread())
        gone.set()

    front = AsyncEngine(factory, while_building=beside)
    try:
        assert ran_on == [threading.main_thread()]
        assert front._thread is not threading.main_thread()
        (tokens,) = streams_at_once(front, [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(tokens) == 3
    finally:
        front.shutdown()


class _HoldingEngine:
    """An engine whose scheduler always holds its waiting work back (a OneShot gather's
    hold of `hold_s`, or a policy's window when 0): idle, no outputs."""

    heads_heavy = False
    idle = True

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s

    def has_unfinished(self) -> bool:
        return True

    def step(self, on_heads: object = None) -> list:  # noqa: ARG002
        return []

    def take_handoffs(self) -> list:
        return []


class _Naps(threading.Event):
    """The loop's wake-up event, noting each nap's timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.napped = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        self.napped.set()
        return super().wait(timeout)


@pytest.mark.parametrize("hold_s,nap_s", [(0.0004, 0.0004), (0.0, NAP_S), (0.05, NAP_S)],
                         ids=["short-hold", "policy-window", "long-hold"])
def test_the_loop_naps_no_longer_than_a_hold_lasts(hold_s: float, nap_s: float) -> None:
    """A lone long prompt's gather hold of 0.4 ms (5% of a GPU step) took the loop's whole
    2 ms nap before: ~2 ms more per request at c=1 with 512-token prompts on an H200."""
    front = AsyncEngine(lambda: _HoldingEngine(hold_s))  # type: ignore[arg-type, return-value]
    naps = _Naps()
    front._wake = naps  # the loop reads it each iteration
    try:
        assert naps.napped.wait(10)
    finally:
        front.shutdown()
    assert naps.timeouts[0] == pytest.approx(nap_s)
