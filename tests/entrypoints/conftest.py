"""A real uvicorn server on loopback over the tiny random Llama engine."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import pytest
import uvicorn

from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.entrypoints.openai.api_server import build_app

from tests.engine.tiny import hf_tiny_llama, tiny_engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(front: AsyncEngine, **app_options: Any) -> Iterator[str]:
    """A real uvicorn server for `front` (build_app(front, **app_options)) on a free
    loopback port; yields its base URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(front, **app_options), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        front.shutdown()


@pytest.fixture(scope="package")
def served() -> Iterator[tuple[str, LLMEngine]]:
    engine = tiny_engine(hf_tiny_llama(), num_blocks=256, max_model_len=256)
    with running_server(AsyncEngine(engine)) as base:
        yield base, engine
