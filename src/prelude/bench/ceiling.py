"""The machine's ceiling: the model's own forward with no server, engine or scheduler.

Trunk + last-token logits + argmax for whole prompts, exactly what a 1-output-token
request needs, timed in this process. A fresh thread builds the model and runs every
forward (torch's OpenMP team belongs to the thread that first used it).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _on_fresh_thread(fn: Callable[[], T]) -> T:
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    t = threading.Thread(target=run, name="prelude-ceiling")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return box[0]


def _build_engine(dtype: str) -> Any:
    from prelude.config import CacheConfig, EngineConfig
    from prelude.engine.engine import LLMEngine

    return LLMEngine.from_config(EngineConfig(dtype=dtype, cache=CacheConfig(num_blocks=64)))


def _forward_seconds(engine: Any, prompts: Sequence[Sequence[int]], iters: int, warmup: int = 2) -> list[float]:
    """Wall time of one batched forward of `prompts` (varlen, no padding), per iteration."""
    import torch

    from prelude.engine.batch import OneShotRow

    rows = [OneShotRow(f"raw{i}", list(p), None, None) for i, p in enumerate(prompts)]
    times: list[float] = []
    for i in range(iters + warmup):
        t0 = time.perf_counter()
        hidden, starts = engine.runner.forward_oneshot(rows)
        last = torch.tensor([s + len(p) - 1 for s, p in zip(starts, prompts)])
        engine.model.compute_logits(hidden[last]).argmax(-1)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def raw_forward_seconds(ids: Sequence[int], dtype: str, iters: int) -> list[float]:
    """Per-iteration seconds of one prompt's forward on a fresh engine."""
    return _on_fresh_thread(lambda: _forward_seconds(_build_engine(dtype), [ids], iters))


def measure_ceilings(
    prompt_short: Sequence[int], prompts_long: Sequence[Sequence[int]], dtype: str, iters: int,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
) -> dict[str, Any]:
    """Median ms of the short prompt alone, and requests/s of batched forwards of the long
    prompts at each batch size (distinct prompts per row); the best batch is the ceiling."""

    def run() -> dict[str, Any]:
        engine = _build_engine(dtype)
        short_ms = 1000 * statistics.median(_forward_seconds(engine, [prompt_short], iters))
        batched: dict[int, float] = {}
        for b in batch_sizes:
            if b > len(prompts_long):
                break
            t = statistics.median(_forward_seconds(engine, prompts_long[:b], max(3, iters // b)))
            batched[b] = b / t
        best = max(batched, key=batched.__getitem__)
        return {"forward_short_ms": short_ms, "batched_long_req_s": batched, "best_batch": best,
                "best_long_req_s": batched[best]}

    return _on_fresh_thread(run)
