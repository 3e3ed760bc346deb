"""/v1/files + /v1/batches with the unmodified openai client on a real (tiny) engine:
the round trip, the error file, cancel, a restart that resumes, the API key and 413."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import uvicorn

from prelude.engine.async_engine import AsyncEngine
from prelude.entrypoints.batch.job import JobOptions, run_job
from prelude.entrypoints.batch.store import BatchStore
from prelude.entrypoints.batch.worker import BatchRunner, BatchRunnerConfig
from prelude.entrypoints.openai.api_server import build_app
from prelude.entrypoints.openai.limits import ServerLimits

from tests.batch.conftest import completion_line, read_output, write_lines
from tests.entrypoints.conftest import _free_port

openai = pytest.importorskip("openai")
KEY = "sk-batch"


@contextmanager
def _server(front: AsyncEngine, batch_dir: Path, max_body_bytes: int = 1 << 20) -> Iterator[Any]:
    app = build_app(front, api_key=KEY, limits=ServerLimits(max_body_bytes=max_body_bytes), batch_dir=batch_dir)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(400):
        if server.started:
            break
        time.sleep(0.025)
    try:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0), base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _wait(client: Any, batch_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled")) -> Any:
    deadline = time.monotonic() + 300  # a bound on a hang, not a speed assertion
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def test_openai_client_round_trip_with_error_file(front: AsyncEngine, tmp_path: Path) -> None:
    lines = [completion_line(f"q{i}", f"question {i}") for i in range(6)]
    lines += [{"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 0}},
              {"custom_id": "other-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    with _server(front, tmp_path / "batches") as (client, _):
        uploaded = client.files.create(file=inp.open("rb"), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == inp.stat().st_size
        assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
        assert uploaded.id in [f.id for f in client.files.list(purpose="batch").data]
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                      completion_window="24h", metadata={"job": "t"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "t"}
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.in_progress_at and done.finalizing_at and done.completed_at
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 6, 2)
        good = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        bad = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in good) == [f"q{i}" for i in range(6)]
        assert all(x["response"]["status_code"] == 200 for x in good)
        assert good[0]["response"]["body"]["object"] == "text_completion"
        assert {x["custom_id"]: (x["response"] or {}).get("status_code") or x["error"]["code"] for x in bad} == \
            {"bad": 400, "other-url": "mismatched_url"}
        assert done.id in [b.id for b in client.batches.list().data]
        assert client.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_0123")


def test_duplicate_custom_ids_fail_the_batch(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("a", "x"), completion_line("a", "y")])
    with _server(front, tmp_path / "batches") as (client, _):
        fid = client.files.create(file=inp.open("rb"), purpose="batch").id
        done = _wait(client, client.batches.create(input_file_id=fid, endpoint="/v1/completions",
                                                   completion_window="24h").id)
        assert done.status == "failed" and done.errors.data[0].code == "duplicate_custom_id"


def test_api_key_and_body_limit_apply(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [completion_line(f"q{i}", "z" * 200) for i in range(40)])
    with _server(front, tmp_path / "batches", max_body_bytes=2048) as (client, base):
        assert httpx.get(base + "/v1/files").status_code == 401
        assert httpx.post(base + "/v1/batches", json={}).status_code == 401
        with pytest.raises(openai.APIStatusError) as too_big:
            client.files.create(file=inp.open("rb"), purpose="batch")
        assert too_big.value.status_code == 413


class _Held:
    """The engine, holding every request until `release` is set and noting whether each
    came as a low-priority one."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.release = asyncio.Event()
        self.low_priority: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any, **kwargs: Any) -> Any:
        self.low_priority.append(params.low_priority)
        await self.release.wait()
        async for out in self._engine.generate(request_id, prompt_token_ids, params, **kwargs):
            yield out


def test_batch_lines_are_low_priority_requests_bounded_in_flight_and_cancel(front: AsyncEngine,
                                                                           tmp_path: Path) -> None:
    """Batch lines reach the engine as low-priority requests (the scheduler runs them behind
    interactive ones), at most `max_inflight` at once; a cancel lets those finish and
    starts no other."""
    store = BatchStore(tmp_path / "batches")
    inp = write_lines(tmp_path / "in.jsonl", [completion_line(f"q{i}", "x") for i in range(5)])
    fid = store.new_file_id()
    store.file_path(fid).write_bytes(inp.read_bytes())
    store.add_file(fid, "in.jsonl", "batch")

    async def scenario() -> tuple[dict[str, Any], list[bool]]:
        held = _Held(front)
        runner = BatchRunner(held, store, ServerLimits(), config=BatchRunnerConfig(max_inflight=2))  # type: ignore[arg-type]
        batch = store.new_batch("/v1/completions", fid, "24h", None)
        runner.submit(batch["id"])
        while len(held.low_priority) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # a third line would have gone in by now if the window let it
        assert len(held.low_priority) == 2
        assert runner.cancel(batch["id"])["status"] == "cancelling"
        held.release.set()
        while store.batch(batch["id"])["status"] != "cancelled":
            await asyncio.sleep(0.01)
        await runner.stop()
        return store.batch(batch["id"]), held.low_priority

    done, low_priority = asyncio.run(scenario())
    assert low_priority == [True, True]
    assert done["cancelled_at"] and done["request_counts"] == {"total": 5, "completed": 2, "failed": 0}


def test_a_restarted_server_resumes_an_unfinished_batch(front: AsyncEngine, tmp_path: Path) -> None:
    """A batch left in_progress with part of its lines answered (as a killed server leaves
    it) is finished by the next server: every custom_id once, the earlier answers kept."""
    inp = write_lines(tmp_path / "in.jsonl", [completion_line(f"q{i}", f"question {i}") for i in range(8)])
    earlier = tmp_path / "earlier.jsonl"
    asyncio.run(run_job(front, inp, earlier, JobOptions(max_inflight=4)))
    kept = earlier.read_bytes().splitlines(keepends=True)[:3]
    store = BatchStore(tmp_path / "batches")
    fid = store.new_file_id()
    store.file_path(fid).write_bytes(inp.read_bytes())
    store.add_file(fid, "in.jsonl", "batch")
    batch = store.new_batch("/v1/completions", fid, "24h", None)
    batch["status"] = "in_progress"
    store.save_batch(batch)
    store.work_log(batch["id"]).write_bytes(b"".join(kept) + kept[0][:10])  # and a torn line
    with _server(front, tmp_path / "batches") as (client, _):
        done = _wait(client, batch["id"])
        assert done.status == "completed" and done.request_counts.completed == 8
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == [f"q{i}" for i in range(8)]
    earlier_ids = {json.loads(k)["id"] for k in kept}
    assert earlier_ids <= {x["id"] for x in out}  # the answered lines were not run again
    assert read_output(earlier)  # the reference run wrote its lines


def test_a_decisions_batch(front: AsyncEngine, tmp_path: Path) -> None:
    question = {"type": "choice", "instructions": "Pick.", "choices": [{"value": "a"}, {"value": "b"}]}
    lines = [{"custom_id": f"d{i}", "method": "POST", "url": "/v1/decisions",
              "body": {"input": f"ticket {i}", "questions": [question, {"type": "predicate", "instructions": "Ok."}]}}
             for i in range(3)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/decisions",
                  "body": {"input": "x", "questions": [{**question, "choices": [{"value": "a"}]}]}})
    inp = write_lines(tmp_path / "in.jsonl", lines)
    with _server(front, tmp_path / "batches") as (client, _):
        fid = client.files.create(file=inp.open("rb"), purpose="batch").id
        done = _wait(client, client.batches.create(input_file_id=fid, endpoint="/v1/decisions",
                                                   completion_window="24h").id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 1)
        good = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        for line in good:
            answers = line["response"]["body"]["answers"]
            assert [a["type"] for a in answers] == ["choice", "predicate"]
        bad = json.loads(client.files.content(done.error_file_id).text)
        assert bad["response"]["body"]["error"]["param"] == "questions.0.choices"
