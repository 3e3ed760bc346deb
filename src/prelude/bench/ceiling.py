"""Prelude's own eager forward with no server, engine or scheduler (not the machine's
limit: that is the GEMM roofline of bench/roofline.py, measured next to it).

Trunk + last-token logits + argmax for whole prompts, exactly what a 1-output-token
request needs, timed in this process. One worker thread builds the model and runs every
forward (torch's OpenMP team belongs to the thread that first used it), so the ceiling
can be measured between server requests, in the same minutes as they are.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class RawModel:
    """The default model on its own thread; `with RawModel(dtype) as raw: ...`."""

    def __init__(self, dtype: str) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prelude-ceiling")
        self._engine = self._worker.submit(_build_engine, dtype).result()

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


def _build_engine(dtype: str) -> Any:
    from prelude.config import CacheConfig, EngineConfig, ExecutorConfig
    from prelude.engine.engine import LLMEngine

    return LLMEngine.from_config(EngineConfig(executor=ExecutorConfig(device="cpu", dtype=dtype), cache=CacheConfig(num_blocks=64)))


def _roofline(engine: Any, prompt_tokens: int) -> tuple[float, float]:
    from prelude.bench.roofline import DecoderShape, roofline_req_s

    return roofline_req_s(DecoderShape.of(engine.runner.model.config), engine.runner.model.dtype, prompt_tokens)


def _forward_seconds(engine: Any, prompts: Sequence[Sequence[int]], iters: int, warmup: int) -> list[float]:
    import torch

    from prelude.forward_batch import OneShotRow

    rows = [OneShotRow(f"raw{i}", list(p), None, None) for i, p in enumerate(prompts)]
    last = torch.tensor([sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))])
    times: list[float] = []
    for i in range(iters + warmup):
        t0 = time.perf_counter()
        hidden, _ = engine.runner.forward_oneshot(rows)
        engine.runner.model.compute_logits(hidden[last]).argmax(-1)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def raw_forward_seconds(ids: Sequence[int], dtype: str, iters: int) -> list[float]:
    """Per-iteration seconds of one prompt's forward on a fresh model."""
    with RawModel(dtype) as raw:
        return raw.forward_seconds([ids], iters, warmup=3)
