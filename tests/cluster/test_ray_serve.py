"""Prelude as a Ray Serve application: the same HTTP API through Serve's proxy, two
engine replicas, greedy outputs equal to one engine. Slow: Serve starts a controller
and an HTTP proxy."""

from __future__ import annotations

import socket
import time
from typing import Iterator

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from prelude.engine.engine import LLMEngine  # noqa: E402
from prelude.engine.request import SamplingParams  # noqa: E402
from prelude.entrypoints.ray_serve import build_serve_app  # noqa: E402

from tests.cluster.tiny_replica import tiny_factory  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LLMEngine]]:
    factory = tiny_factory(tmp_path_factory.mktemp("tiny"))
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_serve_app(factory, num_replicas=2, replica_threads=1), name="prelude", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    try:
        yield base, factory()
    finally:
        serve.shutdown()


def test_serve_app_answers_like_one_engine(served) -> None:  # noqa: ANN001
    base, engine = served
    prompts = ["hello world", "the quick brown fox", "abc"]
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    for i, p in enumerate(prompts):
        engine.add_request(f"ref-{i}", list(p.encode()), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    texts: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
    assert got == [texts[f"ref-{i}"] for i in range(3)]
    streamed = ""
    with httpx.stream("POST", base + "/v1/completions", json={**body, "prompt": "abc", "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                import json

                streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert streamed == texts["ref-2"]
    assert httpx.post(base + "/v1/completions", json={"prompt": "x" * 300, "max_tokens": 5}).status_code == 400
