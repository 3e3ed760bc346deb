"""Schemathesis over every route of the server app, in-process (ASGI, no network). Checked
on every generated case (issue 15): no 5xx; every 4xx carries an OpenAI error body
{"error": {message, type, param, code}}; no call hangs (each gets CALL_TIMEOUT_S, past it
the case counts as a hang and fails the test). The number of cases is printed and must
reach MIN_CASES. Slow suite; bounded in cases per operation and in time (each operation
gets an equal share of TIME_BUDGET_S, so a slow route cannot starve the later ones).

The app serves a tiny random Llama with SmolLM2's real vocabulary behind fasttoken, so
generated text goes through the tokenizer a served model uses. To add checks or
operations, extend CHECKS or write another test below: the fixtures (`api_app`,
`fuzz_tally`) are shared.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from prelude.engine.async_engine import AsyncEngine  # noqa: E402
from prelude.entrypoints.openai.api_server import build_app  # noqa: E402
from prelude.model.loading.files import load_model_files  # noqa: E402
from prelude.tokenizer.fasttoken import FastTokenizer  # noqa: E402
from prelude.tokenizer.hf import HFTokenizer  # noqa: E402

from tests.engine.tiny import hf_tiny_llama, tiny_engine  # noqa: E402

CASES_PER_OPERATION = 80
TIME_BUDGET_S = 420.0  # split evenly across operations; past its share an operation's cases are skipped
CALL_TIMEOUT_S = 60.0  # one call longer than this is a hang (the tiny model answers in well under 1 s)
MIN_CASES = 400  # the run must try at least this many cases in all ...
MIN_CASES_PER_OPERATION = 10  # ... and this many per operation that takes inputs


class Tally:
    """Cases tried and responses by status class, per operation and over the module."""

    def __init__(self) -> None:
        self.tried = 0
        self.by_class: Counter[str] = Counter()
        self.by_operation: Counter[str] = Counter()
        self.problems: list[str] = []
        self.started = time.monotonic()


def _describe(case: Any) -> str:
    body = getattr(case, "body", None)
    text = json.dumps(body, default=repr)[:300] if body is not None else "-"
    return f"{case.method} {case.formatted_path} body={text}"


def _no_server_error(case: Any, response: Any) -> str | None:
    if response.status_code >= 500:
        return f"{_describe(case)} -> {response.status_code}: {response.text[:300]}"
    return None


def _client_errors_have_an_openai_body(case: Any, response: Any) -> str | None:
    if not 400 <= response.status_code < 500:
        return None
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"} \
            or not isinstance(error["message"], str) or not error["message"]:
        return f"{_describe(case)} -> {response.status_code} without an OpenAI error body: {response.text[:300]}"
    return None


CHECKS: list[Callable[[Any, Any], str | None]] = [_no_server_error, _client_errors_have_an_openai_body]


def _call_with_timeout(case: Any, timeout_s: float) -> Any:
    """case.call() on its own thread; None when it did not answer within `timeout_s`
    (the thread is left behind as a daemon: the test fails anyway)."""
    answer: list[Any] = []
    failure: list[BaseException] = []

    def call() -> None:
        try:
            answer.append(case.call())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failure.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if failure:
        raise failure[0]
    return answer[0] if answer else None


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
    print(f"\nschemathesis: {tally.tried} cases in {time.monotonic() - tally.started:.0f} s over "
          f"{len(tally.by_operation)} operations, responses by class {dict(sorted(tally.by_class.items()))}, "
          f"{len(tally.problems)} problems")
    for name, count in sorted(tally.by_operation.items()):
        print(f"  {count:4d}  {name}")


@pytest.fixture(scope="module")
def api_schema(api_app: Any) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", api_app)


def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(operation: Any, tally: Tally, max_examples: int, deadline: float) -> None:
    """Up to `max_examples` generated cases of one operation (none past `deadline`), each
    checked by CHECKS. Problems are collected, not raised inside hypothesis: shrinking a
    hang would re-run it at CALL_TIMEOUT_S a time. (Driven through hypothesis directly:
    schemathesis' lazy pytest fixture integration does not run under pytest 9.)"""
    name = f"{operation.method.upper()} {operation.path}"

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def run(case: Any) -> None:
        if time.monotonic() > deadline:
            return
        response = _call_with_timeout(case, CALL_TIMEOUT_S)
        tally.tried += 1
        tally.by_operation[name] += 1
        if response is None:
            tally.by_class["hang"] += 1
            tally.problems.append(f"{_describe(case)}: no answer within {CALL_TIMEOUT_S:.0f} s")
            return
        tally.by_class[f"{response.status_code // 100}xx"] += 1
        tally.problems.extend(p for check in CHECKS if (p := check(case, response)) is not None)

    run()


@pytest.mark.slow
def test_every_route_answers_without_5xx_hangs_or_bare_4xx(api_schema: Any, fuzz_tally: Tally) -> None:
    operations = _operations(api_schema)
    assert {"/tokenize", "/v1/chat/completions", "/score", "/classify"} <= {op.path for op in operations}
    end = time.monotonic() + TIME_BUDGET_S
    for left, operation in zip(range(len(operations), 0, -1), operations):
        share = (end - time.monotonic()) / left  # time an earlier operation left unused passes on
        _fuzz(operation, fuzz_tally, CASES_PER_OPERATION, time.monotonic() + share)
    assert not fuzz_tally.problems, "\n".join(fuzz_tally.problems[:20])
    assert fuzz_tally.tried >= MIN_CASES, f"only {fuzz_tally.tried} cases ran"
    # A GET here takes no parameters: hypothesis has exactly one case for it.
    wanted = {f"{op.method.upper()} {op.path}": 1 if op.method.upper() == "GET" else MIN_CASES_PER_OPERATION
              for op in operations}
    starved = {name for name, n in wanted.items() if fuzz_tally.by_operation[name] < n}
    assert not starved, f"operations with too few cases: {starved}"


class _Case:
    method, formatted_path, body = "POST", "/x", {"a": 1}


class _Response:
    def __init__(self, status_code: int, body: Any) -> None:
        self.status_code, self._body = status_code, body
        self.text = json.dumps(body) if not isinstance(body, str) else body

    def json(self) -> Any:
        return json.loads(self.text)


@pytest.mark.parametrize("status,body,bad", [
    (200, {"ok": 1}, False),
    (400, {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}, False),
    (400, {"detail": "FastAPI's own shape"}, True),
    (404, "Not Found", True),
    (422, {"error": {"message": "m"}}, True),
    (503, {"error": {"message": "m", "type": "t", "param": None, "code": None}}, True),
])
def test_the_checks_catch_what_they_promise(status: int, body: Any, bad: bool) -> None:
    found = [p for check in CHECKS if (p := check(_Case(), _Response(status, body))) is not None]
    assert bool(found) == bad, found
