"""Batch input and Batch API calls that once broke a job or the server: lines no parser or
output line can carry (a lone surrogate in a custom_id, JSON nested past the parser's
depth, an integer of 5,000 digits), a flood of malformed lines, unbounded or unencodable
metadata, a batch failing or cancelled while queued, bodies the off-loop parser refused
with a 500, and the auth header's scheme in lower case."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from prelude.engine.async_engine import AsyncEngine
from prelude.entrypoints.batch.job import JobOptions, JobSummary, run_job, run_planned
from prelude.entrypoints.batch.output import OutputLog
from prelude.entrypoints.batch.plan import plan_job
from prelude.entrypoints.batch.store import BatchStore
from prelude.entrypoints.batch.worker import BatchRunner
from prelude.entrypoints.openai.limits import ServerLimits

from tests.batch.conftest import completion_line, read_output, write_lines
from tests.batch.test_batch_api import KEY, _server, _wait

DEEP = 100_000  # brackets: valid JSON past any parser's recursion


def _unreadable_lines() -> list[Any]:
    deep = '{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "x": ' + \
        "[" * DEEP + "]" * DEEP + "}}"
    huge = '{"custom_id": "huge", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": ' + \
        "1" * 5000 + "}}"
    surrogate = json.dumps(completion_line("bad\ud800", "x"))  # ensure_ascii: the surrogate spelled "\ud800"
    return [completion_line("q0", "one"), surrogate, deep, huge, completion_line("q1", "two")]


def test_lines_no_parser_or_output_line_can_carry_each_get_an_error_line(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", _unreadable_lines())
    out = tmp_path / "out.jsonl"
    summary = asyncio.run(run_job(front, inp, out, JobOptions(max_inflight=4)))
    lines = read_output(out)
    assert len(lines) == 5 and summary.failed == 3
    answered = {x["custom_id"]: x["response"]["status_code"] for x in lines if x["custom_id"] is not None}
    assert answered == {"q0": 200, "q1": 200}
    errors = [x["error"] for x in lines if x["custom_id"] is None]
    assert [e["code"] for e in errors] == ["invalid_custom_id", "invalid_json_line", "invalid_json_line"]
    assert "line 2" in errors[0]["message"] and "nested too deeply" in errors[1]["message"]
    assert "line 4" in errors[2]["message"]


def test_a_flood_of_malformed_lines_gives_the_event_loop_its_turns(front: AsyncEngine, tmp_path: Path) -> None:
    """A server runs batches on its event loop: 2,000 malformed lines answered in one go
    held every other request (/health 11 s for 200,000)."""
    inp = write_lines(tmp_path / "in.jsonl", ["x"] * 2000)
    plan = plan_job(inp)
    log = OutputLog(tmp_path / "out.jsonl", resume=False)
    log.open()

    async def scenario() -> int:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        ticks = 0  # count only the turns while the job runs
        await run_planned(front, inp, plan, log, JobOptions(), JobSummary())
        seen = ticks
        done.set()
        await tick
        return seen

    try:
        assert asyncio.run(scenario()) >= 2000 // 64 - 1
    finally:
        log.close()
    lines = read_output(tmp_path / "out.jsonl")
    assert len(lines) == 2000 and lines[1999]["error"]["message"].startswith("line 2000:")


def _store_with_file(tmp_path: Path, lines: list[Any]) -> tuple[BatchStore, str]:
    store = BatchStore(tmp_path / "batches")
    inp = write_lines(tmp_path / "in.jsonl", lines)
    fid = store.new_file_id()
    store.file_path(fid).write_bytes(inp.read_bytes())
    store.add_file(fid, "in.jsonl", "batch")
    return store, fid


def _run_until_done(front: AsyncEngine, store: BatchStore, batch_id: str) -> dict[str, Any]:
    async def scenario() -> dict[str, Any]:
        runner = BatchRunner(front, store, ServerLimits())
        runner.start()
        for _ in range(30_000):  # a bound on a hang, not a speed assertion
            if store.batch(batch_id)["status"] in ("completed", "failed", "cancelled"):
                break
            await asyncio.sleep(0.01)
        await runner.stop()
        return store.batch(batch_id)

    return asyncio.run(scenario())


def test_a_batch_that_fails_still_delivers_the_lines_it_answered(front: AsyncEngine, tmp_path: Path) -> None:
    """A server killed mid-batch, whose input file was deleted before it came back: the
    batch fails, and the three lines answered before are in its output file."""
    lines = [completion_line(f"q{i}", f"question {i}") for i in range(6)]
    store, fid = _store_with_file(tmp_path, lines)
    earlier = tmp_path / "earlier.jsonl"
    asyncio.run(run_job(front, tmp_path / "in.jsonl", earlier, JobOptions(max_inflight=4)))
    kept = earlier.read_bytes().splitlines(keepends=True)[:3]
    batch = store.new_batch("/v1/completions", fid, "24h", None)
    batch["status"] = "in_progress"
    store.save_batch(batch)
    store.work_log(batch["id"]).write_bytes(b"".join(kept) + kept[0][:10])  # and a torn line
    store.delete_file(fid)
    done = _run_until_done(front, store, batch["id"])
    assert done["status"] == "failed" and done["errors"]["data"][0]["code"] == "missing_input_file"
    assert done["error_file_id"] is None and done["request_counts"]["completed"] == 3
    delivered = store.file_path(done["output_file_id"]).read_bytes().splitlines(keepends=True)
    assert delivered == kept
    assert not store.work_log(batch["id"]).exists()


def test_an_input_file_without_request_lines_fails_the_batch(front: AsyncEngine, tmp_path: Path) -> None:
    store, fid = _store_with_file(tmp_path, ["", "  "])
    done = _run_until_done(front, store, store.new_batch("/v1/completions", fid, "24h", None)["id"])
    assert done["status"] == "failed" and done["errors"]["data"][0]["code"] == "empty_file"


def test_cancelling_a_queued_batch_ends_it_at_once(front: AsyncEngine, tmp_path: Path) -> None:
    """Nothing of a batch still in the queue runs: it needs no wait for the batch ahead."""
    store, fid = _store_with_file(tmp_path, [completion_line("q0", "x")])
    runner = BatchRunner(front, store, ServerLimits())  # not started: the batch stays queued
    batch = store.new_batch("/v1/completions", fid, "24h", None)
    answered = runner.cancel(batch["id"])
    assert answered is not None and answered["status"] == "cancelled"
    kept = store.batch(batch["id"])
    assert kept["status"] == "cancelled" and kept["cancelling_at"] and kept["cancelled_at"]
    assert kept["output_file_id"] is None and kept["request_counts"]["completed"] == 0


def _create(base: str, body: bytes) -> httpx.Response:
    return httpx.post(base + "/v1/batches", content=body,
                      headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})


def test_metadata_is_bounded_and_utf8_and_a_refused_batch_is_not_kept(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("q0", "x")])
    with _server(front, tmp_path / "batches") as (client, base):
        fid = client.files.create(file=inp.open("rb"), purpose="batch").id
        head = f'{{"input_file_id": "{fid}", "endpoint": "/v1/completions", "metadata": '
        refused = {
            "a lone surrogate": head.encode() + b'{"k": "\\ud800"}}',
            "one in a key": head.encode() + b'{"\\udfff": "v"}}',
            "17 pairs": (head + json.dumps({f"k{i}": "v" for i in range(17)}) + "}").encode(),
            "a 65-character key": (head + json.dumps({"k" * 65: "v"}) + "}").encode(),
            "a 513-character value": (head + json.dumps({"k": "v" * 513}) + "}").encode(),
        }
        for what, body in refused.items():
            r = _create(base, body)
            assert r.status_code == 400, what
            assert r.json()["error"]["param"].startswith("metadata"), what
        assert client.batches.list().data == []  # nothing kept, and the list still answers
        kept = client.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h",
                                     metadata={f"k{i}": "v" * 512 for i in range(16)})
        assert len(kept.metadata) == 16
        _wait(client, kept.id)


def test_batches_list_newest_first_within_one_second(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("q0", "x", max_tokens=1)])
    with _server(front, tmp_path / "batches") as (client, _):
        fid = client.files.create(file=inp.open("rb"), purpose="batch").id
        made = [client.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h").id
                for _ in range(5)]
        assert [b.id for b in client.batches.list().data] == made[::-1]
        for batch_id in made:
            _wait(client, batch_id)


def test_bodies_the_parser_refuses_are_400s(front: AsyncEngine, tmp_path: Path) -> None:
    """Bodies of over 64 KiB are parsed off the event loop, small ones on a quick path
    first: JSON nested past the parser's depth (either size) and a 5,000-digit integer
    (over 64 KiB) got 500s there."""
    pad = ', "pad": "' + "a" * 70_000 + '"}'
    bodies = {
        "nested": '{"prompt": "x", "x": ' + "[" * DEEP + "]" * DEEP + "}",
        "integer": '{"prompt": "x", "max_tokens": ' + "1" * 5000 + pad,
        "small and nested": '{"prompt": "x", "x": ' + "[" * 1200 + "]" * 1200 + "}",
    }
    with _server(front, tmp_path / "batches", max_body_bytes=1 << 22) as (_, base):
        for what, body in bodies.items():
            for url in ("/v1/completions", "/v1/chat/completions"):
                r = httpx.post(base + url, content=body.encode(),
                               headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
                assert r.status_code == 400, (what, url)
                assert "not valid JSON" in r.json()["error"]["message"] or \
                    r.json()["error"]["message"] == "There was an error parsing the body", (what, url)


def test_auth_scheme_case_query_param_names_and_a_chunked_413(front: AsyncEngine, tmp_path: Path) -> None:
    with _server(front, tmp_path / "batches", max_body_bytes=2048) as (_, base):
        assert httpx.get(base + "/v1/files", headers={"authorization": f"bearer {KEY}"}).status_code == 200
        assert httpx.get(base + "/v1/files", headers={"authorization": f"Basic {KEY}"}).status_code == 401
        assert httpx.get(base + "/v1/files", headers={"authorization": f"Bearer {KEY}x"}).status_code == 401
        r = httpx.get(base + "/v1/batches?limit=abc", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"

        def chunks() -> Any:
            yield b'{"prompt": "'
            for _ in range(8):
                yield b"x" * 1024
            yield b'"}'

        r = httpx.post(base + "/v1/completions", content=chunks(),
                       headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
