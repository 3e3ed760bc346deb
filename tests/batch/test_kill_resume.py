"""`kill -9` of a real `prelude run-batch` mid-job, then `--resume`: every custom_id
exactly once, with the same greedy answers as a clean run, in float32 and in the dtype
`auto` picks (bf16 on an AVX512-BF16 or AMX CPU: run-batch's batch-invariant default)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.batch.conftest import completion_line, read_output, write_lines

LINES = 400  # the job after the kill point is long next to a 5 ms poll, on any machine
KILL_AT = 20  # output lines seen before the kill


def _command(model: Path, inp: Path, out: Path, dtype: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "prelude.cli", "run-batch", "-i", str(inp), "-o", str(out), "--model", str(model),
            "--dtype", dtype, "--no-progress", "--max-inflight", "8", "--max-num-seqs", "8",
            "--kv-cache-memory-gib", "0.05", "--log-level", "warning", *extra]


def _lines_in(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _answers(path: Path) -> dict[str, str]:
    return {x["custom_id"]: x["response"]["body"]["choices"][0]["text"] for x in read_output(path)}


pytestmark = pytest.mark.slow  # three start-ups of a real process (~1-2 min on a shared 2-core machine)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prelude.testing.random_model import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_kill_9_then_resume_gives_each_id_once_with_clean_answers(model_dir: Path, tmp_path: Path, dtype: str) -> None:
    inp = write_lines(tmp_path / "in.jsonl",
                      [completion_line(f"id-{i}", f"question {i}: " + "word " * (i % 7), max_tokens=8)
                       for i in range(LINES)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    clean = tmp_path / "clean.jsonl"
    subprocess.run(_command(model_dir, inp, clean, dtype), env=env, check=True, timeout=600)

    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_command(model_dir, inp, out, dtype), env=env)
    try:
        while _lines_in(out) < KILL_AT and proc.poll() is None:
            time.sleep(0.005)
        assert proc.poll() is None, "the job finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = _lines_in(out)
    assert KILL_AT <= partial < LINES

    resumed = subprocess.run(_command(model_dir, inp, out, dtype, "--resume"), env=env, timeout=600,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{partial} already done" in resumed.stderr
    ids = [x["custom_id"] for x in read_output(out)]
    assert len(ids) == LINES and set(ids) == {f"id-{i}" for i in range(LINES)}
    assert _answers(out) == _answers(clean)
