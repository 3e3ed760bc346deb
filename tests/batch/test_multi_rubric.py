"""Judge files with several rubrics interleaved: the plan groups each rubric's lines, so
the prefix cache computes each rubric once even when it can hold only one at a time."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prelude.engine.async_engine import AsyncEngine
from prelude.entrypoints.batch.job import JobOptions, run_job
from prelude.entrypoints.batch.plan import plan_job

from tests.batch.conftest import read_output, write_lines
from tests.engine.tiny import hf_tiny_llama, tiny_engine


def _chat(cid: str, system: str, user: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                     "max_tokens": 1, "temperature": 0}}


def test_rubrics_differing_past_the_last_character_cut_are_grouped(tmp_path: Path) -> None:
    """Three rubrics with one long preamble (past every character cut) and their own
    criteria at the end, interleaved line by line: each runs as one group."""
    preamble = "You are a strict judge of answers. " * 200  # 7000 characters
    rubrics = {name: preamble + f"Criterion: {name}." for name in ("accuracy", "clarity", "safety")}
    lines = [_chat(f"{name}-{i}", rubric, "answer " * (1 + i % 5))
             for i in range(8) for name, rubric in rubrics.items()]
    plan = plan_job(write_lines(tmp_path / "in.jsonl", lines))
    order = [lines[n - 1]["custom_id"].split("-")[0] for n in plan.numbers.tolist()]
    runs = [name for k, name in enumerate(order) if k == 0 or order[k - 1] != name]
    assert sorted(runs) == sorted(rubrics)  # one run of lines per rubric
    assert plan.to_run == 24


RUBRIC = 64  # tokens (ByteTokenizer: one per byte), 16 blocks of 4


def test_each_rubric_is_prefilled_once_when_the_cache_holds_one(tmp_path: Path) -> None:
    """A prefix cache of 24 blocks holds one 16-block rubric, not two: run in file order
    (rubrics A, B, C, A, ...) each line would recompute its rubric; planned, every line but
    each rubric's first reuses all of it."""
    rubrics = [chr(ord("A") + r) * RUBRIC for r in range(3)]
    per_rubric = 5
    # Items start with a character of their own, so lines share exactly the rubric.
    lines = [{"custom_id": f"{r}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": rubrics[r] + chr(ord("a") + i) + " item", "max_tokens": 1, "temperature": 0}}
             for i in range(per_rubric) for r in range(3)]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    engine = AsyncEngine(tiny_engine(hf_tiny_llama(), num_blocks=128, block_size=4, max_num_batched_tokens=256,
                                     max_model_len=256, max_cached_blocks=24))
    try:
        summary = asyncio.run(run_job(engine, inp, tmp_path / "out.jsonl", JobOptions(max_inflight=2)))
        metrics = engine.metrics()
    finally:
        engine.shutdown()
    assert summary.failed == 0 and len(read_output(tmp_path / "out.jsonl")) == 15
    followers = 3 * (per_rubric - 1)
    assert metrics["prefix_reused_tokens_total"] >= followers * RUBRIC
