"""Schemathesis over every route of the server app, in-process (ASGI, no network): no
generated request may get a 5xx. Slow suite; bounded in cases per operation and in time.

The app serves a tiny random Llama with SmolLM2's real vocabulary behind fasttoken, so
generated text goes through the tokenizer a served model uses. To add checks or
operations, extend CHECKS or write another `@schema.parametrize()` test below: the
fixtures (`api_app`, `fuzz_tally`) are shared.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from prelude.engine.async_engine import AsyncEngine  # noqa: E402
from prelude.entrypoints.openai.api_server import build_app  # noqa: E402
from prelude.model.loader import load_model_files  # noqa: E402
from prelude.tokenizer.fasttoken import FastTokenizer  # noqa: E402
from prelude.tokenizer.hf import HFTokenizer  # noqa: E402

from tests.engine.tiny import hf_tiny_llama, tiny_engine  # noqa: E402

CASES_PER_OPERATION = 80
TIME_BUDGET_S = 420.0  # across all operations: later cases are skipped (and not counted) past it


class Tally:
    """Cases tried and responses by status class, over the whole module."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + TIME_BUDGET_S
        self.tried = 0
        self.by_class: dict[str, int] = {}
        self.server_errors: list[str] = []


def _no_server_error(case: Any, response: Any) -> str | None:
    if response.status_code >= 500:
        return f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"
    return None


CHECKS: list[Callable[[Any, Any], str | None]] = [_no_server_error]


@pytest.fixture(scope="module")
def api_app() -> Iterator[Any]:
    model_dir = load_model_files(None).model_dir
    tokenizer = FastTokenizer(model_dir / "tokenizer.json", delegate=HFTokenizer.from_dir(model_dir))
    engine = tiny_engine(hf_tiny_llama(vocab_size=tokenizer.vocab_size), tokenizer=tokenizer,
                         num_blocks=256, max_model_len=128)
    front = AsyncEngine(engine)
    try:
        yield build_app(front)
    finally:
        front.shutdown()
        engine.check_integrity()


@pytest.fixture(scope="module")
def fuzz_tally() -> Iterator[Tally]:
    tally = Tally()
    yield tally
    print(f"\nschemathesis: {tally.tried} cases, responses by class {dict(sorted(tally.by_class.items()))}, "
          f"{len(tally.server_errors)} server errors")


@pytest.fixture(scope="module")
def api_schema(api_app: Any) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", api_app)


def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(operation: Any, tally: Tally, max_examples: int) -> None:
    """Up to `max_examples` generated cases of one operation, each checked by CHECKS.
    (Driven through hypothesis directly: schemathesis' lazy pytest fixture integration
    does not run under pytest 9.)"""

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def run(case: Any) -> None:
        if time.monotonic() > tally.deadline:
            return
        response = case.call()
        tally.tried += 1
        key = f"{response.status_code // 100}xx"
        tally.by_class[key] = tally.by_class.get(key, 0) + 1
        problems = [p for check in CHECKS if (p := check(case, response)) is not None]
        tally.server_errors.extend(problems)
        assert not problems, problems

    run()


@pytest.mark.slow
def test_no_route_answers_5xx(api_schema: Any, fuzz_tally: Tally) -> None:
    operations = _operations(api_schema)
    assert {"/tokenize", "/v1/chat/completions", "/score", "/classify"} <= {op.path for op in operations}
    for operation in operations:
        _fuzz(operation, fuzz_tally, CASES_PER_OPERATION)
    assert fuzz_tally.tried >= len(operations)
    assert not fuzz_tally.server_errors
