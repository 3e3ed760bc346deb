"""`prelude serve --api-server-count 2`: two HTTP processes over one engine process, as
real processes over the tiny random Llama. The routes behave as in one process (outputs
equal the offline engine's), limits, auth, request ids, aborts and metrics hold across
processes; SIGTERM drains; a killed engine process fails every waiting request with a
5xx error body and the server exits non-zero."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Iterator

import httpx
import pytest

from prelude.testing.random_model import tiny_llama_dir
from prelude.bench.server_proc import free_port

KEY = "sk-multiproc"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _die_with_parent() -> None:
    """The server gets SIGTERM (a drain) if this test process is killed: no orphan servers."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Server:
    """A `prelude serve --api-server-count 2` process (and its children)."""

    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prelude.cli", "serve", "--model", str(tiny_llama_dir()), "--dtype", "float32",
             "--port", str(self.port), "--api-server-count", "2", "--api-key", KEY, *extra],
            stdout=subprocess.DEVNULL, stderr=self.log, preexec_fn=_die_with_parent)
        self.health = self._wait_for_both_fronts()

    def _wait_for_both_fronts(self, timeout_s: float = 300.0) -> dict[int, dict[str, Any]]:
        """Until /health, over fresh connections, has answered from both HTTP processes."""
        seen: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(seen) < 2:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {self.logs()[-3000:]}")
            try:
                r = httpx.get(self.base + "/health", timeout=5)
                if r.status_code == 200:
                    seen[r.json()["api_server"]] = r.json()
            except httpx.HTTPError:
                time.sleep(0.1)
        return seen

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _post(base: str, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=kw.pop("headers", AUTH), timeout=120, **kw)


def _events(r: httpx.Response) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in r.iter_lines() if line.startswith("data: ")]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    s = _Server("--max-num-seqs", "2", "--max-waiting-requests", "2")
    yield s
    s.stop()


def test_completions_and_chat_equal_the_offline_engine(server: _Server) -> None:
    from prelude.engine.request import SamplingParams
    from prelude.entrypoints.llm import LLM

    prompt = [5, 17, 99, 1234, 42]
    ref = LLM(str(tiny_llama_dir()), dtype="float32").generate(
        prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].text
    for _ in range(4):  # fresh connections: both HTTP processes answer
        r = _post(server.base, "/v1/completions",
                  {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    chat = _post(server.base, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"


def test_streaming_and_abort_on_disconnect(server: _Server) -> None:
    body = {"prompt": "stream", "max_tokens": 6, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        events = _events(r)
    assert events[-1] == "[DONE]" and len(events) == 7 and events[-2]["choices"][0]["finish_reason"] == "length"
    # A client that leaves mid-stream: its request is aborted in the engine process.
    long = {"prompt": "leave early", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=long, headers=AUTH, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 120
    while True:
        state = httpx.get(server.base + "/debug/integrity", headers=AUTH, timeout=30).json()
        if state["requests_in_engine"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert state["ok"] and state["requests_in_engine"] == 0 and state["blocks_held"] == 0, state


def test_embeddings_classify_and_structured_outputs(server: _Server) -> None:
    answers = [_post(server.base, "/v1/embeddings", {"input": ["one", "two"]}).json() for _ in range(3)]
    vectors = [[d["embedding"] for d in a["data"]] for a in answers]
    assert vectors[0] == vectors[1] == vectors[2] and vectors[0][0] != vectors[0][1]
    assert sum(x * x for x in vectors[0][0]) == pytest.approx(1.0, abs=1e-4)
    c = _post(server.base, "/classify", {"input": ["judge this"], "labels": ["a", "b"]}).json()
    assert c["data"][0]["label"] in ("a", "b") and sum(c["data"][0]["probs"]) == pytest.approx(1.0, abs=1e-4)
    r = _post(server.base, "/v1/completions", {"prompt": "id:", "max_tokens": 20, "guided_regex": r"[a-c]{4}"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in {a + b + c + d for a in "abc" for b in "abc"
                                                                      for c in "abc" for d in "abc"}
    bad = _post(server.base, "/v1/completions", {"prompt": "x", "guided_regex": "((("})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_api_key_and_request_ids(server: _Server) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    assert _post(server.base, "/v1/completions", body, headers={}).status_code == 401
    assert _post(server.base, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = _post(server.base, "/v1/completions", body, headers={**AUTH, "X-Request-Id": "my-id-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-123"
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200  # open without the key


def test_429_past_the_waiting_bound(server: _Server) -> None:
    """--max-waiting-requests 2 over 2 processes (one each). The engine process is stopped
    (SIGSTOP) during a burst of 12, so no request gets its first output and none stops waiting:
    each HTTP process lets one through and refuses the rest with 429 and Retry-After, whatever
    the machine's speed. Once the engine continues, every request let through completes."""
    engine_pid = server.health[0]["engine_pid"]
    body = {"prompt": "burst", "max_tokens": 30, "ignore_eos": True}
    with ThreadPoolExecutor(12) as pool:
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            futures = [pool.submit(_post, server.base, "/v1/completions", body) for _ in range(12)]
            refused = [f.result() for _, f in zip(range(10), as_completed(futures))]
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        answers = [f.result() for f in futures]
    assert [a.status_code for a in refused] == [429] * 10
    statuses = [a.status_code for a in answers]
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 10, statuses
    for a in answers:
        if a.status_code == 429:
            assert a.headers["retry-after"] and a.json()["error"]["type"] == "rate_limit_error"
        else:
            assert a.json()["usage"]["completion_tokens"] == 30


def test_metrics_aggregate_every_process(server: _Server) -> None:
    """Every scrape, whichever process answers it, counts the requests of both."""
    before = httpx.get(server.base + "/metrics", timeout=30).text
    route = {"route": "/v1/completions", "status": "200"}
    n0 = _metric(before, "prelude:http_requests_total", **route)
    done0 = _metric(before, "prelude:request_success_total")
    for _ in range(8):
        assert _post(server.base, "/v1/completions", {"prompt": "count me", "max_tokens": 1}).status_code == 200
    for _ in range(6):  # fresh connections: both processes answer some scrapes
        text = httpx.get(server.base + "/metrics", timeout=30).text
        assert _metric(text, "prelude:http_requests_total", **route) == n0 + 8
        assert _metric(text, "prelude:request_success_total") >= done0 + 8
        assert _metric(text, "prelude:kv_blocks", state="free") > 0  # the engine's gauges, asked over the wire


@pytest.mark.slow
def test_sigterm_drains_then_exits_0() -> None:
    s = _Server("--shutdown-timeout", "300")
    try:
        started = threading.Event()

        def stream() -> list[Any]:
            body = {"prompt": "drain", "max_tokens": 12, "ignore_eos": True, "stream": True}
            events: list[Any] = []
            with httpx.stream("POST", s.base + "/v1/completions", json=body, headers=AUTH, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        started.set()
            return events

        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(stream)
            assert started.wait(120)
            s.proc.send_signal(signal.SIGTERM)
            events = future.result(timeout=300)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=120) == 0
    finally:
        s.stop()


@pytest.mark.slow
def test_engine_process_death_fails_waiting_requests_and_exits_nonzero() -> None:
    s = _Server("--max-num-seqs", "1")
    engine_pid = s.health[0]["engine_pid"]
    try:
        started = threading.Event()

        def stream() -> tuple[int, list[Any]]:
            body = {"prompt": "dies", "max_tokens": 1800, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", s.base + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
                events: list[Any] = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        started.set()
                return r.status_code, events

        with ThreadPoolExecutor(4) as pool:
            streaming = pool.submit(stream)
            assert started.wait(120)
            # Waiting behind the stream (one sequence at a time): these have no output yet.
            waiting = [pool.submit(_post, s.base, "/v1/completions", {"prompt": "wait", "max_tokens": 4})
                       for _ in range(3)]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # until the engine holds all three in its queue
                text = httpx.get(s.base + "/metrics", timeout=30).text
                if _metric(text, "prelude:num_requests_waiting") >= 3:
                    break
                time.sleep(0.05)
            os.kill(engine_pid, signal.SIGKILL)
            status, events = streaming.result(timeout=120)
            answers = [f.result(timeout=120) for f in waiting]
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events[-3:]
        for a in answers:  # waiting when the engine died: a 5xx with an OpenAI-style body, never a hang
            assert a.status_code >= 500 and a.json()["error"]["message"], a.text
        assert s.proc.wait(timeout=120) != 0
    finally:
        s.stop()


@pytest.mark.slow
def test_ray_replicas_behind_two_http_processes() -> None:
    """--data-parallel-size 1 --api-server-count 2: each HTTP process has its own Ray
    client over the same named replica (which runs the engine)."""
    pytest.importorskip("ray")
    s = _Server("--data-parallel-size", "1")
    try:
        assert {h["replicas_total"] for h in s.health.values()} == {1}
        for _ in range(4):
            r = _post(s.base, "/v1/completions", {"prompt": [5, 17, 99], "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert _post(s.base, "/v1/completions", {"prompt": "x"}, headers={}).status_code == 401
        text = httpx.get(s.base + "/metrics", timeout=60).text
        assert _metric(text, "prelude:http_requests_total", route="/v1/completions", status="200") == 4
    finally:
        s.stop()
    assert s.proc.returncode == 0
