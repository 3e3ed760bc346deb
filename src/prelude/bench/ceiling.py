"""Prelude's own eager forward with no server, engine or scheduler (not the machine's
limit: that is the GEMM roofline of bench/roofline.py, measured next to it).

Trunk + last-token logits + argmax for whole prompts, exactly what a 1-output-token
request needs, timed in this process. One worker thread builds the model and runs every
forward (torch's OpenMP team belongs to the thread that first used it), so the ceiling
can be measured between server requests, in the same minutes as they are.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class RawModel:
    """A model (default: the default model) on its own thread; `with RawModel(dtype) as raw: ...`."""

    def __init__(self, dtype: str, model: str | None = None) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prelude-ceiling")
        self._engine = self._worker.submit(_build_engine, dtype, model).result()
        # The GEMM roofline counts a dense decoder's projections: MoE and hybrid models have none
        spec = getattr(self._engine.runner.model, "spec", None)
        self.dense = spec is not None and spec.is_plain_llama() is None

    def __enter__(self) -> RawModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._engine = None

    def forward_seconds(self, prompts: Sequence[Sequence[int]], iters: int = 1, warmup: int = 0) -> list[float]:
        """Seconds of one batched forward of `prompts` (varlen, no padding), per iteration."""
        return self._worker.submit(_forward_seconds, self._engine, prompts, iters, warmup).result()

    def roofline(self, prompt_tokens: int) -> tuple[float, float]:
        """(GEMM FLOP/s, req/s bound) of whole-prompt 1-output requests, on this worker's
        thread (the same OpenMP team as the forwards), in the model's dtype."""
        return self._worker.submit(_roofline, self._engine, prompt_tokens).result()

    def waves_req_s(self, prompts: Sequence[Sequence[int]], wave: int) -> float:
        """Requests/s of 1-output `prompts` through this process's engine (prefix cache on),
        `wave` at a time: each wave handed over at once and run to its end, no HTTP. What a
        server that clients keep at concurrency `wave` can reach at best (the judge's
        in-process figure: its waves' shared prefix is cold in the first one only)."""
        return self._worker.submit(_waves_req_s, self._engine, prompts, wave).result()

    def batched(
        self, prompts_long: Sequence[Sequence[int]], iters: int, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16)
    ) -> dict[int, float]:
        """Requests/s of one batched forward of the first b long prompts, per batch size b."""
        batched: dict[int, float] = {}
        for b in batch_sizes:
            if b > len(prompts_long):
                break
            t = statistics.median(self.forward_seconds(prompts_long[:b], max(3, iters // b), warmup=1))
            batched[b] = b / t
        return batched


def _build_engine(dtype: str, model: str | None) -> Any:
    from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
    from prelude.engine.engine import LLMEngine

    # 256 blocks: a judge wave's cold prefix and its rows (1,024 + 16 x 64 tokens) fit. No
    # burst hold: a wave is handed over whole, as the offline LLM's requests are.
    return LLMEngine.from_config(EngineConfig(model=model, executor=ExecutorConfig(device="cpu", dtype=dtype),
                                              cache=CacheConfig(num_blocks=256),
                                              scheduler=SchedulerConfig(oneshot_gather_ms=0.0)))


def _roofline(engine: Any, prompt_tokens: int) -> tuple[float, float]:
    from prelude.bench.roofline import DecoderShape, roofline_req_s

    return roofline_req_s(DecoderShape.of(engine.runner.model.config), engine.runner.model.dtype, prompt_tokens)


def _forward_seconds(engine: Any, prompts: Sequence[Sequence[int]], iters: int, warmup: int) -> list[float]:
    import torch

    from prelude import SamplingParams
    from prelude.forward_batch import OneShotBatch, OneShotRow, SampleSpec

    greedy = SamplingParams(temperature=0.0)
    batch = OneShotBatch(tuple(OneShotRow(f"raw{i}", list(p), SampleSpec(greedy, list(p), []), None)
                               for i, p in enumerate(prompts)))
    times: list[float] = []
    for i in range(iters + warmup):
        t0 = time.perf_counter()
        with torch.inference_mode():  # the serving trunk: a CPU's last layer computes the last positions only
            hidden, starts, _, reads = engine.runner.trunk(batch)
            last = starts if reads is not None else [s + len(p) - 1 for s, p in zip(starts, prompts)]
            engine.runner.model.compute_logits(hidden[torch.tensor(last)]).argmax(-1)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


_WAVE_IDS = itertools.count()


def drain(engine: Any) -> int:
    """Run `engine` until every request it holds is answered; how many steps that took."""
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def run_wave(engine: Any, prompts: Sequence[Sequence[int]], params: Any, ids: Iterator[int]) -> int:
    """One wave: every prompt handed over before the first step, then the engine drained;
    how many steps that took."""
    for prompt in prompts:
        engine.add_request(f"wave{next(ids)}", list(prompt), params)
    return drain(engine)


def _waves_req_s(engine: Any, prompts: Sequence[Sequence[int]], wave: int) -> float:
    from prelude.params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), wave):
        run_wave(engine, prompts[start:start + wave], one, _WAVE_IDS)
    return len(prompts) / (time.perf_counter() - t0)


def raw_forward_seconds(ids: Sequence[int], dtype: str, iters: int) -> list[float]:
    """Per-iteration seconds of one prompt's forward on a fresh model."""
    with RawModel(dtype) as raw:
        return raw.forward_seconds([ids], iters, warmup=3)
