"""Start and stop `prelude serve` subprocesses for benchmarks (loopback only)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def scrape_metrics(base: str) -> dict[str, float]:
    """A server's Prometheus samples by name, the `prelude:` or `vllm:` prefix dropped, summed
    over label sets; {} from a server without a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        page = httpx.get(base + "/metrics", timeout=10)
    except httpx.HTTPError:
        return out
    if page.status_code != 200:
        return out
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            name = sample.name.removeprefix("prelude:").removeprefix("vllm:")
            out[name] = out.get(name, 0.0) + sample.value
    return out


def prefix_hit_tokens(before: dict[str, float], after: dict[str, float]) -> tuple[float, float] | None:
    """(prompt tokens served from the prefix cache, prompt tokens looked up) between two
    scrapes of `scrape_metrics`: Prelude's reused/computed token counters, or vLLM's
    token-counted prefix-cache hits/queries; None where the server counts neither."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    if "prefix_cache_reused_tokens_total" in after:
        reused = delta("prefix_cache_reused_tokens_total")
        return reused, reused + delta("prefix_cache_computed_tokens_total")
    if "prefix_cache_queries_total" in after and "prefix_cache_hits_total" in after:
        return delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total")
    return None


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process and its waited-for children used
    so far (Linux /proc; 0.0 elsewhere). vLLM's engine core is a child process: its time
    is read from the children it has (not yet waited for) as well."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, ValueError, IndexError):
            pass
    return total



def wait_until_idle(pids: list[int], window_s: float = 0.1, busy_fraction: float = 0.2, limit_s: float = 5.0) -> float:
    """Wait, at most `limit_s`, until the processes `pids` (children included) used less
    than `busy_fraction` of one core over a `window_s` window: an idle server's OpenMP
    threads spin for a while after its last request (vLLM's for KMP_BLOCKTIME), and a peer
    measured meanwhile shares the cores with that spin. Returns the seconds waited."""
    t0 = time.monotonic()
    if not pids:
        return 0.0
    before = sum(cpu_seconds(p) for p in pids)
    while time.monotonic() - t0 < limit_s:
        time.sleep(window_s)
        now = sum(cpu_seconds(p) for p in pids)
        if now - before < busy_fraction * window_s:
            break
        before = now
    return time.monotonic() - t0


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, parents first (Linux /proc; just `pid` elsewhere)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        tree.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return tree


@contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    """The processes `pids` and their descendants stopped (SIGSTOP) for the block, resumed
    after: each server measured alone. An idle vLLM CPU server still wakes now and then,
    and those wake-ups stall a measured server's two-thread OpenMP team at its barriers."""
    tree = [q for p in pids if p for q in process_tree(p)]
    stopped = []
    try:
        for q in tree:
            try:
                os.kill(q, signal.SIGSTOP)
                stopped.append(q)
            except ProcessLookupError:
                pass
        yield
    finally:
        for q in reversed(stopped):
            try:
                os.kill(q, signal.SIGCONT)
            except ProcessLookupError:
                pass


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process's main thread alone (Linux /proc; 0.0
    elsewhere): a Python server's event loop (HTTP parsing, validation, responses), apart
    from its engine and OpenMP threads and its children."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick
    except (OSError, ValueError, IndexError):
        return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server_process(
    cmd: list[str], port: int, timeout_s: float = 300.0, env: dict[str, str] | None = None, ready_path: str = "/health",
    started: list[subprocess.Popen] | None = None,
) -> Iterator[str]:
    """Run `cmd` (a server listening on 127.0.0.1:`port`) until `ready_path` answers 200;
    yields its base URL and stops it afterwards. `started` receives the process."""
    # Logs go to a file, not a pipe: a chatty server (llama.cpp) would block on a full pipe.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    if started is not None:
        started.append(proc)
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
