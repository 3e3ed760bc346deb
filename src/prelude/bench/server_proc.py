"""Start and stop `prelude serve` subprocesses for benchmarks (loopback only)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server_process(cmd: list[str], port: int, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `cmd` (a server listening on 127.0.0.1:`port`) until /health answers; yields
    its base URL and stops it afterwards."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise TimeoutError(f"server on {base} did not become healthy")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def prelude_server(args: list[str], timeout_s: float = 120.0) -> Iterator[str]:
    """Yields the base URL of a running `prelude serve` started with extra CLI `args`."""
    port = free_port()
    cmd = [sys.executable, "-m", "prelude.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    with server_process(cmd, port, timeout_s) as base:
        yield base
