"""`prelude run-batch` against a user's mistakes: paths and flags refused in one line before
the model loads, OUTPUT lines it cannot resume from, a refused job that leaves OUTPUT as it
was, the exit status counting failures already in OUTPUT, another input's lines kept with a
warning, Ctrl-C, and the body limit the server applies."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import pytest

from prelude import cli as prelude_cli
from prelude.engine.async_engine import AsyncEngine
from prelude.entrypoints.batch import cli
from prelude.entrypoints.batch.job import JobOptions, run_job
from prelude.entrypoints.batch.output import OutputFileError, OutputLog
from prelude.entrypoints.batch.plan import DuplicateCustomIds
from prelude.entrypoints.openai.limits import ServerLimits

from tests.batch.conftest import completion_line, read_output, write_lines


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = prelude_cli.main(["run-batch", *argv, "--no-progress"])
    return rc, capsys.readouterr().err


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the model loads: building the engine fails the test."""
    monkeypatch.setattr(prelude_cli, "_front", lambda args: pytest.fail("the engine was built"))


def test_paths_a_job_cannot_use_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        no_engine: None) -> None:
    good = write_lines(tmp_path / "in.jsonl", [completion_line("a", "x")])
    before = good.read_bytes()
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "pipe")
    cases = {
        "missing": (tmp_path / "nope.jsonl", tmp_path / "o.jsonl", "INPUT"),
        "folder in": (tmp_path / "folder", tmp_path / "o.jsonl", "not a regular file"),
        "pipe in": (tmp_path / "pipe", tmp_path / "o.jsonl", "not a regular file"),
        "folder out": (good, tmp_path / "folder", "not a regular file"),
        "out under a file": (good, good / "o.jsonl", "is not a folder"),
        "out is in": (good, tmp_path / "." / "in.jsonl", "is INPUT"),
    }
    for what, (inp, out, said) in cases.items():
        rc, err = _main(capsys, "-i", str(inp), "-o", str(out))
        assert rc == 2 and said in err and "Traceback" not in err and err.count("\n") == 1, what
    os.link(good, tmp_path / "hard.jsonl")
    rc, err = _main(capsys, "-i", str(good), "-o", str(tmp_path / "hard.jsonl"), "--resume")
    assert rc == 2 and "is INPUT" in err
    assert good.read_bytes() == before


def test_engine_flags_are_checked_as_serve_checks_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       no_engine: None) -> None:
    good = write_lines(tmp_path / "in.jsonl", [completion_line("a", "x")])
    for flags in (["--max-num-seqs", "0"], ["--block-size", "0"], ["--max-model-len", "0"],
                  ["--max-inflight", "0"], ["--model", str(tmp_path / "no-model")]):
        rc, err = _main(capsys, "-i", str(good), "-o", str(tmp_path / "o.jsonl"), *flags)
        assert rc == 2 and err.startswith("prelude run-batch: error: ") and flags[0] in err, flags


def test_output_lines_it_cannot_resume_from_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    for bad in ({"custom_id": 7, "response": None, "error": None},
                {"custom_id": ["a"], "response": None, "error": None},
                {"custom_id": "a", "response": "x", "error": None}):
        out.write_text(json.dumps(bad) + "\n")
        with pytest.raises(OutputFileError, match="line 1 is not a batch output line"):
            OutputLog(out, resume=True)


def test_a_refused_job_leaves_output_as_it_was(front: AsyncEngine, tmp_path: Path) -> None:
    """Even its torn last line: cut only when the job opens OUTPUT to run."""
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("a", "x"), completion_line("a", "y")])
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"custom_id": "b", "response": {"status_code": 200}, "error": null}\n{"custom_id": "c", "re')
    before = out.read_bytes()
    with pytest.raises(DuplicateCustomIds):
        asyncio.run(run_job(front, inp, out, resume=True))
    assert out.read_bytes() == before


def test_resume_counts_earlier_failures_and_keeps_another_inputs_lines(front: AsyncEngine, tmp_path: Path) -> None:
    lines = [completion_line("a", "x"), {"custom_id": "bad", "method": "POST", "url": "/v1/nope", "body": {}}]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    first = asyncio.run(run_job(front, inp, out))
    assert first.failed == 1
    with open(out, "a") as f:  # a line of another job
        f.write(json.dumps({"id": "x", "custom_id": "elsewhere", "response": {"status_code": 200, "body": {}},
                            "error": None}) + "\n")
    again = asyncio.run(run_job(front, inp, out, resume=True))
    assert again.ran == 0 and again.failed == 0
    assert again.already_failed == 1 and again.foreign_lines == 1
    assert len(read_output(out)) == 3


def _args(tmp_path: Path, inp: Path) -> argparse.Namespace:
    return argparse.Namespace(lora_modules=[], max_inflight=None, max_num_seqs=4, progress=False,
                              input_file=str(inp), output_file=str(tmp_path / "out.jsonl"), resume=True)


def test_exit_status_counts_failures_already_in_output(front: AsyncEngine, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("a", "x"), "{broken"])
    assert cli.run_batch(_args(tmp_path, inp), front, ServerLimits()) == 1
    assert cli.run_batch(_args(tmp_path, inp), front, ServerLimits()) == 1  # nothing ran: the failure is kept
    assert "0 lines run" in capsys.readouterr().err


def test_ctrl_c_ends_in_one_line_and_status_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    async def interrupted(*a: object, **kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_job", interrupted)
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("a", "x")])
    assert cli.run_batch(_args(tmp_path, inp), object(), ServerLimits()) == 130
    err = capsys.readouterr().err
    assert "--resume" in err and "Traceback" not in err


def test_a_line_over_the_body_limit_gets_the_servers_413(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("small", "x"), completion_line("big", "y" * 3000)])
    out = tmp_path / "out.jsonl"
    asyncio.run(run_job(front, inp, out, JobOptions(limits=ServerLimits(max_body_bytes=1000))))
    answers = {x["custom_id"]: x["response"] for x in read_output(out)}
    assert answers["small"]["status_code"] == 200
    assert answers["big"]["status_code"] == 413 and answers["big"]["body"]["error"]["code"] == "request_too_large"
