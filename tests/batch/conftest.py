"""A tiny random Llama behind an AsyncEngine, and helpers to write batch files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from prelude.engine.async_engine import AsyncEngine

from tests.engine.tiny import hf_tiny_llama, tiny_engine

pytest.importorskip("transformers")


@pytest.fixture(scope="package")
def front() -> Iterator[AsyncEngine]:
    engine = AsyncEngine(tiny_engine(hf_tiny_llama(), num_blocks=256, max_model_len=256, max_num_batched_tokens=256))
    yield engine
    engine.shutdown()


def write_lines(path: Path, lines: list[Any]) -> Path:
    """Objects are written as JSON lines; strings as they are (malformed lines)."""
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def completion_line(cid: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
