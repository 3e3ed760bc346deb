"""The real engine behind the HTTP server: openai client round trips, bad input, and
KV blocks freed after a burst of streams the clients abandon."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

from prelude.engine.engine import LLMEngine

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")


def _wait_idle(engine: LLMEngine, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_openai_client_completion_chat_and_stream(served) -> None:  # noqa: ANN001
    base, engine = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    assert model == "tiny-llama"
    comp = client.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert comp.usage.prompt_tokens == 5 and comp.usage.completion_tokens == 5
    assert comp.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="hello", max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        if c.choices
    )
    assert streamed == comp.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x" * 300, max_tokens=5)
    _wait_idle(engine)
    engine.check_integrity()


def _finished_ids(engine: LLMEngine) -> set[str]:
    return {m.request_id for m in engine.finished_metrics}


def test_abandoned_streams_free_their_blocks(served) -> None:  # noqa: ANN001
    """Fails with a no-op `LLMEngine.abort`: 240-token ignore_eos generations would run
    to their end and be recorded as finished; aborted, none of them is."""
    base, engine = served
    _wait_idle(engine)
    before = _finished_ids(engine)
    body = {"prompt": "abandon me", "max_tokens": 240, "stream": True, "ignore_eos": True, "temperature": 0}

    def open_and_drop() -> None:
        with httpx.Client(timeout=10) as c:
            with c.stream("POST", base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # the client walks away after the first chunk

    threads = [threading.Thread(target=open_and_drop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _wait_idle(engine, 60)
    assert not engine.has_unfinished()
    assert _finished_ids(engine) == before  # every generation was aborted, none finished
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks
    # ... and the server still serves.
    r = httpx.post(base + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200


def test_a_stream_the_client_leaves_is_logged_as_cancel_and_a_whole_one_as_200(served, caplog, monkeypatch) -> None:  # noqa: ANN001
    base, engine = served
    _wait_idle(engine)
    launch = engine.runner.launch

    def slow_launch(batch, *rest):  # noqa: ANN001, ANN002, ANN202 - the stream outlasts the client's first chunk
        time.sleep(0.01)
        return launch(batch, *rest)

    monkeypatch.setattr(engine.runner, "launch", slow_launch)
    body = {"prompt": "stream", "max_tokens": 200, "stream": True, "ignore_eos": True, "temperature": 0}
    with caplog.at_level(logging.INFO):
        with httpx.stream("POST", base + "/v1/completions", json=body, headers={"x-request-id": "left-early"},
                          timeout=30) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        short = {**body, "max_tokens": 2}
        with httpx.stream("POST", base + "/v1/completions", json=short, headers={"x-request-id": "stayed"},
                          timeout=30) as r:
            assert "data: [DONE]" in list(r.iter_lines())
        _wait_idle(engine, 60)
        for _ in range(100):  # the access line is written once the response has ended
            if sum(" left-early " in r.getMessage() or " stayed " in r.getMessage() for r in caplog.records) == 2:
                break
            time.sleep(0.05)
    lines = {line.split()[1]: line for line in (r.getMessage() for r in caplog.records)
             if line.startswith(("cancelled", "finished"))}
    assert lines["left-early"].startswith("cancelled") and " 499 " in lines["left-early"], lines
    assert lines["stayed"].startswith("finished") and " 200 " in lines["stayed"], lines


def test_non_streaming_client_that_leaves_is_aborted_and_logged_as_cancel(served, caplog, monkeypatch) -> None:  # noqa: ANN001
    base, engine = served
    _wait_idle(engine)
    before = _finished_ids(engine)
    body = {"prompt": "leave early", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    launch = engine.runner.launch

    def slow_launch(batch, *rest):  # noqa: ANN001, ANN002, ANN202 - 240 steps now outlast the client's 0.3 s on any machine
        time.sleep(0.01)
        return launch(batch, *rest)

    monkeypatch.setattr(engine.runner, "launch", slow_launch)
    with caplog.at_level(logging.INFO):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, timeout=0.3)
        _wait_idle(engine, 60)
        for _ in range(100):  # the access line is written once the handler has returned
            if any("cancelled" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.05)
    assert not engine.has_unfinished() and _finished_ids(engine) == before
    engine.check_integrity()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("cancelled") and " 499 " in line for line in lines), lines
    assert not any("unhandled error" in line for line in lines), lines
