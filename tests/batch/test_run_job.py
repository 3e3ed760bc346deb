"""`run_job` on a real (tiny) engine: the OpenAI Batch shapes, bad lines, duplicate
custom_ids, resuming after a torn write, and answers equal to the server route's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from prelude.engine.async_engine import AsyncEngine
from prelude.entrypoints.batch.job import JobOptions, run_job
from prelude.entrypoints.batch.plan import DuplicateCustomIds
from prelude.entrypoints.openai.api_server import build_app

from tests.batch.conftest import completion_line, read_output, write_lines


def _run(front: AsyncEngine, inp: Path, out: Path, resume: bool = False, max_inflight: int = 8):  # noqa: ANN202
    return asyncio.run(run_job(front, inp, out, JobOptions(max_inflight=max_inflight), resume=resume))


def test_every_line_gets_one_answer_in_openai_shape(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [
        completion_line("ok-1", "hello"),
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}},
        {"custom_id": "emb-1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "some text"}},
        "{this is not json",
        {"custom_id": "url-1", "method": "POST", "url": "/v1/nowhere", "body": {}},
        {"custom_id": "body-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}},
        {"custom_id": "long-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y" * 400}},
        {"custom_id": "method-1", "method": "GET", "url": "/v1/completions", "body": {}},
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}},
        completion_line("ok-2", "world"),
    ])
    out = tmp_path / "out.jsonl"
    summary = _run(front, inp, out)
    lines = read_output(out)
    assert len(lines) == 10 and summary.ran == 10 and summary.failed == 6
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["id"].startswith("batch_req_")
    by_id = {line["custom_id"]: line for line in lines if line["custom_id"]}
    for cid in ("ok-1", "ok-2", "chat-1", "emb-1"):
        assert by_id[cid]["error"] is None and by_id[cid]["response"]["status_code"] == 200
        assert set(by_id[cid]["response"]) == {"status_code", "request_id", "body"}
    assert by_id["ok-1"]["response"]["body"]["object"] == "text_completion"
    assert by_id["ok-1"]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert by_id["chat-1"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["emb-1"]["response"]["body"]["data"][0]["object"] == "embedding"
    assert by_id["url-1"]["response"]["status_code"] == 404
    assert by_id["body-1"]["response"]["status_code"] == 400
    assert by_id["body-1"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert by_id["long-1"]["response"]["status_code"] == 400
    assert "context" in by_id["long-1"]["response"]["body"]["error"]["message"]
    assert by_id["method-1"]["response"] is None and by_id["method-1"]["error"]["code"] == "invalid_method"
    unnamed = [line for line in lines if line["custom_id"] is None]
    assert [u["error"]["code"] for u in unnamed] == ["invalid_json_line", "missing_custom_id"]
    assert unnamed[0]["error"]["message"].startswith("line 4:")
    assert unnamed[1]["error"]["message"].startswith("line 9:")


def test_a_line_answers_what_the_server_route_answers(front: AsyncEngine, tmp_path: Path) -> None:
    body = {"prompt": "the same prompt", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
    inp = write_lines(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                                "body": body}])
    out = tmp_path / "out.jsonl"
    _run(front, inp, out)
    batch_body = read_output(out)[0]["response"]["body"]

    async def over_http() -> dict:
        transport = httpx.ASGITransport(app=build_app(front))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.post("/v1/completions", json=body)).json()

    http_body = asyncio.run(over_http())
    for drop in ("id", "created"):
        batch_body.pop(drop), http_body.pop(drop)
    assert batch_body == http_body


def test_duplicate_custom_ids_refuse_the_job_before_anything_runs(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("a", "x"), completion_line("b", "y"),
                                              completion_line("a", "z")])
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier job's output\n")
    with pytest.raises(DuplicateCustomIds, match=r"'a' \(lines 1 and 3\)"):
        _run(front, inp, out)
    assert out.read_text() == "an earlier job's output\n"


def test_resume_runs_only_missing_ids_and_repairs_a_torn_last_line(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl",
                      ["not json"] + [completion_line(f"r{i}", f"prompt number {i}") for i in range(12)])
    clean = tmp_path / "clean.jsonl"
    _run(front, inp, clean)
    whole = clean.read_bytes().splitlines(keepends=True)
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(b"".join(whole[:5]) + whole[5][: len(whole[5]) // 2])  # killed mid-write of line 6
    summary = _run(front, inp, torn, resume=True)
    assert summary.repaired_bytes == len(whole[5]) // 2
    assert summary.already_done == 5 and summary.ran == 8
    resumed = read_output(torn)
    ids = [line["custom_id"] for line in resumed]
    assert sorted(ids, key=str) == sorted([None] + [f"r{i}" for i in range(12)], key=str)

    def texts(lines: list[dict]) -> dict:
        return {x["custom_id"]: x["response"]["body"]["choices"][0]["text"] for x in lines if x["custom_id"]}

    assert texts(resumed) == texts(read_output(clean))
    again = _run(front, inp, torn, resume=True)
    assert again.ran == 0 and again.already_done == 13 and len(read_output(torn)) == 13


def test_outputs_round_trip_as_json_lines(front: AsyncEngine, tmp_path: Path) -> None:
    inp = write_lines(tmp_path / "in.jsonl", [completion_line("quote\"\n", "a\nb")])
    out = tmp_path / "out.jsonl"
    _run(front, inp, out)
    raw = out.read_text()
    assert raw.count("\n") == 1 and json.loads(raw)["custom_id"] == "quote\"\n"
