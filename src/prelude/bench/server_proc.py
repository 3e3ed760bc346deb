"""Start and stop `prelude serve` subprocesses for benchmarks (loopback only)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server_process(
    cmd: list[str], port: int, timeout_s: float = 300.0, env: dict[str, str] | None = None, ready_path: str = "/health"
) -> Iterator[str]:
    """Run `cmd` (a server listening on 127.0.0.1:`port`) until `ready_path` answers 200;
    yields its base URL and stops it afterwards."""
    # Logs go to a file, not a pipe: a chatty server (llama.cpp) would block on a full pipe.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited: {log.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(base + ready_path, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise TimeoutError(f"server on {base} did not become healthy")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextmanager
def prelude_server(args: list[str], timeout_s: float = 120.0) -> Iterator[str]:
    """Yields the base URL of a running `prelude serve` started with extra CLI `args`."""
    port = free_port()
    cmd = [sys.executable, "-m", "prelude.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    with server_process(cmd, port, timeout_s) as base:
        yield base
