"""Overload and drain against a real uvicorn server over the tiny engine.

Overload: a burst at 4x --max-waiting-requests gets 429s, every admitted request
completes, the waiting count never passes the bound. Drain: SIGTERM's handler during a
burst of streams stops admission (503) and every stream ends cleanly, complete within
the shutdown timeout or with an explicit error event past it; then the server exits.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import uvicorn

from prelude.engine.async_engine import AsyncEngine
from prelude.entrypoints.openai.api_server import build_app
from prelude.entrypoints.openai.drain import DrainingServer
from prelude.entrypoints.openai.limits import ServerLimits

from tests.engine.tiny import hf_tiny_llama, tiny_engine
from tests.entrypoints.conftest import _free_port

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    return hf_tiny_llama()


class _Served:
    def __init__(self, hf_model: Any, limits: ServerLimits, max_num_seqs: int = 16) -> None:
        self.engine = tiny_engine(hf_model, num_blocks=256, max_model_len=256, max_num_seqs=max_num_seqs)
        self.front = AsyncEngine(self.engine)
        self.app = build_app(self.front, limits=limits)
        port = _free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", log_config=None)
        self.server = DrainingServer(config, self.app.state.gate, limits.shutdown_timeout_s, self.front)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.front.shutdown()


def _stream(base: str, body: dict[str, Any], started: threading.Event | None = None) -> tuple[int, list[Any]]:
    """Status and parsed events of one streamed completion; raises on a cut connection."""
    events: list[Any] = []
    with httpx.Client(timeout=60) as c, c.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(r.read())]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if started is not None:
                    started.set()
    return 200, events


def _hold_steps(engine: Any) -> threading.Event:
    """Make the engine's forwards wait until the returned event is set: requests admitted
    meanwhile stay waiting to start, however fast or slow the machine."""
    release = threading.Event()
    launch = engine.runner.launch

    def held(*args: Any) -> Any:
        release.wait(120)
        return launch(*args)

    engine.runner.launch = held
    return release


def test_burst_at_4x_the_bound_gets_429s_and_the_let_through_complete(hf_model: Any) -> None:
    served = _Served(hf_model, ServerLimits(max_waiting_requests=4), max_num_seqs=2)
    gate = served.app.state.gate
    release = _hold_steps(served.engine)
    body = {"prompt": "burst", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    try:
        with ThreadPoolExecutor(4) as pool:
            admitted = [pool.submit(httpx.post, served.base + "/v1/completions", json=body, timeout=120)
                        for _ in range(4)]
            deadline = time.monotonic() + 60  # a condition with a generous deadline, not a delay
            while gate.waiting < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert gate.waiting == 4
            # 12 more (a burst at 4x the bound) while none of the 4 can start: each is refused.
            refused = [httpx.post(served.base + "/v1/completions", json=body, timeout=60) for _ in range(12)]
            assert gate.waiting == 4  # the bound held: the queue never grew past it
            release.set()
            answers = [f.result(timeout=120) for f in admitted]
    finally:
        release.set()
    assert [r.status_code for r in refused] == [429] * 12 and gate.rejected_overload == 12
    for r in refused:
        assert r.headers["retry-after"] and r.json()["error"]["type"] == "rate_limit_error"
    for a in answers:
        assert a.status_code == 200 and a.json()["choices"][0]["finish_reason"] == "length"
        assert a.json()["usage"]["completion_tokens"] == 40
    served.close()
    served.engine.check_integrity()
    assert served.engine.kv.num_available_blocks == served.engine.kv.pool.num_blocks


@pytest.mark.parametrize("timeout_s,max_tokens", [(20.0, 30), (0.3, 240)], ids=["finish", "cut-off"])
def test_sigterm_during_a_burst_of_streams(hf_model: Any, timeout_s: float, max_tokens: int) -> None:
    served = _Served(hf_model, ServerLimits(shutdown_timeout_s=timeout_s), max_num_seqs=16)
    body = {"prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    started = [threading.Event() for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_stream, served.base, body, started[i]) for i in range(8)]
        for s in started:
            assert s.wait(60)
        if timeout_s < 1:  # the engine stalls now: the drain times out on any machine
            release = _hold_steps(served.engine)
        served.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        refused = httpx.post(served.base + "/v1/completions", json={"prompt": "late"}, timeout=10)
        results = [f.result(timeout=60) for f in futures]  # a cut connection raises here
        if timeout_s < 1:
            release.set()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        last = events[-2]
        if timeout_s > 1:  # everyone finishes within the timeout
            assert last["choices"][0]["finish_reason"] == "length"
        else:  # past the timeout: an explicit error event, never a silent cut
            assert last["error"]["code"] == "server_shutting_down"
    served.thread.join(timeout=30)
    assert not served.thread.is_alive()  # the server shut itself down after the drain
    served.front.shutdown()
    served.engine.check_integrity()
    assert served.engine.kv.num_available_blocks == served.engine.kv.pool.num_blocks


@pytest.mark.slow
def test_prelude_serve_exits_0_after_sigterm_drain() -> None:
    """The real process: SIGTERM mid-stream, the stream completes, exit code 0."""
    import subprocess
    import sys

    from prelude.bench.server_proc import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prelude.cli", "serve", "--port", str(port),
                             "--shutdown-timeout", "300", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(3000):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        started = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            body = {"prompt": "Count to twenty:", "max_tokens": 8, "ignore_eos": True, "stream": True}
            future = pool.submit(_stream, base, body, started)
            assert started.wait(120)
            proc.send_signal(signal.SIGTERM)
            status, events = future.result(timeout=300)
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2].get("choices", [{}])[0].get("finish_reason") == "length", events[-3:]
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_prelude_serve_stopped_right_after_ready_exits_0() -> None:
    """SIGTERM at the first 200 from /health, while start-up's threads (oneDNN's packed
    copies) may still run: exit code 0, no abort. (The copies' thread inherited the engine
    thread's daemon flag and aborted the process here; the deterministic check is
    tests/executor/test_pack_at_start.py.)"""
    import subprocess
    import sys

    from prelude.bench.server_proc import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prelude.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(6000):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert "terminate called" not in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_signal_ends_the_requests_in_flight_with_an_error_and_stops(
        hf_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The impatient second Ctrl+C during a drain: the streams and the plain request in
    flight get the 503 error answer at once (not a cut connection, not uvicorn's plain-text
    500), the server stops without waiting for the shutdown timeout, and nothing is logged
    as an error (uvicorn logged a cancelled handler's and its lifespan's tracebacks)."""
    served = _Served(hf_model, ServerLimits(shutdown_timeout_s=300), max_num_seqs=16)
    release = _hold_steps(served.engine)  # nothing finishes on its own: the drain would wait 300 s
    body = {"prompt": "stop me", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    caplog.set_level("INFO")
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream, served.base, {**body, "stream": True}) for _ in range(3)]
        plain = pool.submit(lambda: httpx.post(served.base + "/v1/completions", json=body, timeout=60))
        deadline = time.monotonic() + 60
        while served.app.state.gate.active < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.app.state.gate.active == 4
        served.server.handle_exit(signal.SIGINT, None)
        served.server.handle_exit(signal.SIGINT, None)
        results = [f.result(timeout=60) for f in streams]
        answer = plain.result(timeout=60)
    served.thread.join(timeout=30)
    assert not served.thread.is_alive()  # stopped with the engine still held: it waited for nothing
    release.set()  # the held step ends; the aborted requests' blocks come back
    deadline = time.monotonic() + 60
    while served.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "server_shutting_down"
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "server_shutting_down"
    assert "second SIGINT: stopping now" in caplog.text
    assert not [(r.name, r.getMessage()) for r in caplog.records if r.levelname == "ERROR"]
    served.front.shutdown()
    served.engine.check_integrity()
    assert served.engine.kv.num_available_blocks == served.engine.kv.pool.num_blocks
