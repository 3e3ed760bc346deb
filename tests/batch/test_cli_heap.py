"""`prelude run-batch` freezes the start-up heap once the engine is loaded, before the job
runs (heap.py says why), as `prelude serve` does."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prelude.entrypoints.batch import cli
from prelude.entrypoints.openai.limits import ServerLimits


def test_run_batch_freezes_the_heap_before_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(cli, "freeze_startup_heap", lambda: events.append("freeze") or 1)
    real_run_job = cli.run_job

    async def run_job(*a, **kw):  # type: ignore[no-untyped-def]
        events.append("job")
        return await real_run_job(*a, **kw)

    monkeypatch.setattr(cli, "run_job", run_job)
    (tmp_path / "in.jsonl").write_text("")
    args = argparse.Namespace(lora_modules=[], max_inflight=None, max_num_seqs=4, progress=False,
                              input_file=str(tmp_path / "in.jsonl"), output_file=str(tmp_path / "out.jsonl"),
                              resume=False)
    assert cli.run_batch(args, object(), ServerLimits()) == 0
    assert events == ["freeze", "job"]


def test_run_batch_freezes_its_modules_before_the_engine_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """So the collection once loaded walks only what loading built (heap.freeze_imports)."""
    from prelude import cli as prelude_cli
    from prelude import heap

    events: list[str] = []

    class Front:
        def shutdown(self) -> None:
            events.append("shutdown")

    monkeypatch.setattr(heap, "freeze_imports", lambda: events.append("freeze imports"))
    monkeypatch.setattr(prelude_cli, "_front", lambda args: events.append("front") or Front())
    monkeypatch.setattr(cli, "run_batch", lambda args, front, limits: events.append("job") or 0)
    args = argparse.Namespace()
    monkeypatch.setattr(prelude_cli, "_server_limits", lambda a: ServerLimits())
    assert prelude_cli._run_batch(args) == 0
    assert events == ["freeze imports", "front", "job", "shutdown"]
