"""`prelude bench soak`: a long mixed load against a real server, with client cancels and
malformed requests, then the books are checked.

Every request ends in exactly one bucket: answered (2xx, streams through `[DONE]`),
rejected (4xx with an OpenAI error body), or cancelled by the client. Anything else
(a 5xx, a cut connection, a stream without `[DONE]`, a 4xx without an error body) is a
failure. At the end the server's block pool must pass its integrity check with every
block free or cached, and its resident memory must have grown less than 10% after
warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from prelude.bench.results import write_json

KINDS = ("chat_stream", "completion_stop", "completion_n", "classify", "embed", "score", "prompt_logprobs",
         "malformed")
_WORDS = ("the quick brown fox jumps over a lazy dog while seven judges weigh every answer with care "
          "and a router picks the model that fits").split()


@dataclass(frozen=True)
class SoakSpec:
    requests: int = 10_000
    concurrency: int = 32
    cancel_fraction: float = 0.10
    seed: int = 0
    warmup_fraction: float = 0.1  # RSS baseline taken after this share of the requests


@dataclass
class SoakResult:
    outcomes: Counter = field(default_factory=Counter)  # answered | rejected | cancelled | failed
    by_kind: dict[str, Counter] = field(default_factory=dict)
    # Outcomes by the client's plan and kind, "keep:<kind>" (read to the end) or
    # "cancel:<kind>" (leave early): only a planned cancel may end "cancelled", and a
    # stream's planned cancel always does (see _one).
    by_plan: dict[str, Counter] = field(default_factory=dict)
    streams_cancelled_planned: int = 0
    failures: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    rss_warm_mib: float | None = None
    rss_end_mib: float | None = None
    integrity: dict[str, Any] | None = None
    seconds: float = 0.0

    def add(self, kind: str, outcome: str, detail: str = "", planned_cancel: bool = False) -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        self.by_plan.setdefault(f"{'cancel' if planned_cancel else 'keep'}:{kind}", Counter())[outcome] += 1
        if outcome == "failed" and len(self.failures) < 50:
            self.failures.append(f"{kind}: {detail}")

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    @property
    def rss_growth(self) -> float | None:
        if not self.rss_warm_mib or self.rss_end_mib is None:
            return None
        return self.rss_end_mib / self.rss_warm_mib - 1

    def verdict(self, spec: SoakSpec) -> list[str]:
        """Broken promises; empty when the soak passed."""
        problems = []
        if self.total != spec.requests:
            problems.append(f"accounting: {self.total} outcomes for {spec.requests} requests")
        kept_cancelled = sum(c["cancelled"] for k, c in self.by_plan.items() if k.startswith("keep:"))
        if kept_cancelled:
            problems.append(f"{kept_cancelled} requests the client read to the end were counted cancelled")
        if self.outcomes["failed"]:
            problems.append(f"{self.outcomes['failed']} failed requests (5xx, cut, or bad error body)")
        if self.integrity is None or not self.integrity.get("ok"):
            problems.append(f"integrity check: {self.integrity}")
        elif self.integrity.get("blocks_held") or self.integrity.get("requests_in_engine"):
            problems.append(f"blocks still held at the end: {self.integrity}")
        growth = self.rss_growth
        if growth is not None and growth >= 0.10:
            problems.append(f"RSS grew {100 * growth:.1f}% after warm-up")
        return problems

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {
            "outcomes": dict(self.outcomes), "by_kind": {k: dict(v) for k, v in self.by_kind.items()},
            "by_plan": {k: dict(v) for k, v in self.by_plan.items()},
            "failures": self.failures, "rss_warm_mib": self.rss_warm_mib, "rss_end_mib": self.rss_end_mib,
            "rss_growth": self.rss_growth, "integrity": self.integrity, "seconds": self.seconds,
            "req_per_s": self.total / self.seconds if self.seconds else None,
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p99_s": lat[int(0.99 * (len(lat) - 1))] if lat else None,
        }


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _request(kind: str, rng: random.Random, model: str) -> tuple[str, Any, bool]:
    """(path, JSON body or raw bytes, stream) of one request of `kind`."""
    if kind == "chat_stream":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": _text(rng, rng.randint(3, 30))}],
            "max_tokens": rng.randint(4, 24), "stream": True, "temperature": 0.7, "seed": rng.randrange(2**32),
            "stream_options": {"include_usage": True}}, True
    if kind == "completion_stop":
        return "/v1/completions", {"model": model, "prompt": _text(rng, rng.randint(3, 40)),
                                   "max_tokens": rng.randint(4, 24), "stop": [" the", "."], "temperature": 0}, False
    if kind == "completion_n":
        return "/v1/completions", {"model": model, "prompt": _text(rng, rng.randint(3, 20)), "n": rng.randint(2, 3),
                                   "max_tokens": rng.randint(2, 12), "temperature": 1.0,
                                   "stream": rng.random() < 0.5}, False
    if kind == "classify":
        return "/classify", {"model": model, "input": [_text(rng, rng.randint(3, 20)) for _ in range(rng.randint(1, 4))],
                             "labels": ["yes", "no"]}, False
    if kind == "embed":
        return "/v1/embeddings", {"model": model, "input": [_text(rng, rng.randint(2, 30))
                                                            for _ in range(rng.randint(1, 4))]}, False
    if kind == "score":
        return "/v1/score", {"model": model, "text_1": _text(rng, 5),
                             "text_2": [_text(rng, rng.randint(3, 15)) for _ in range(rng.randint(1, 3))]}, False
    if kind == "prompt_logprobs":
        return "/v1/completions", {"model": model, "prompt": _text(rng, rng.randint(3, 60)), "max_tokens": 1,
                                   "echo": True, "logprobs": rng.randint(0, 3)}, False
    bad: list[tuple[str, Any]] = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}),
        ("/v1/completions", {"prompt": 12}),
        # An answer-changing field the server does not implement. (Not response_format: since
        # structured outputs landed, json_object is served, to the full context when unbounded.)
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
        ("/v1/completions", {"prompt": "x", "seed": -1}),
        ("/v1/embeddings", {"input": []}),
        ("/v1/completions", {"prompt": [10**9]}),
    ]
    path, body = rng.choice(bad)
    return path, body, False


def _is_error_body(data: Any) -> bool:
    err = data.get("error") if isinstance(data, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)


async def _one(client: httpx.AsyncClient, kind: str, path: str, body: Any, cancel_after: float | None,
               result: SoakResult, log_failures: bool = False) -> None:
    """One request. A planned cancel (`cancel_after` not None) of a stream leaves right after
    its first event, so it always lands mid-request whatever the machine's speed; any other
    planned cancel leaves after `cancel_after` seconds, or not at all if the answer came first."""
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    stream = isinstance(body, dict) and bool(body.get("stream"))
    leave_after_first_event = stream and cancel_after is not None
    if leave_after_first_event:
        result.streams_cancelled_planned += 1

    async def run() -> tuple[str, str]:
        async with client.stream("POST", path, **kwargs) as r:
            if r.status_code >= 500:
                return "failed", f"{r.status_code} {(await r.aread())[:200]!r}"
            if r.status_code >= 400:
                data = json.loads(await r.aread())
                return ("rejected", "") if _is_error_body(data) else ("failed", f"{r.status_code} without error body")
            if not stream:
                data = json.loads(await r.aread())
                return ("answered", "") if "error" not in data else ("failed", f"error in a 200: {data}")
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"error"' in line:
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "failed", f"error event {event}"
                elif line.startswith("data: ") and leave_after_first_event:
                    return "cancelled", ""  # leaving the block closes the connection mid-stream
            return ("answered", "") if done else ("failed", "stream ended without [DONE]")

    task = asyncio.ensure_future(run())
    try:
        if cancel_after is None or leave_after_first_event:
            outcome, detail = await task
        else:
            done, _ = await asyncio.wait({task}, timeout=cancel_after)
            if done:
                outcome, detail = task.result()
            else:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                outcome, detail = "cancelled", ""
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome, detail = "failed", f"{type(exc).__name__}: {exc}"
    if outcome == "answered":
        result.latencies_s.append(time.perf_counter() - t0)
    elif outcome == "failed" and log_failures:  # a long run shows what broke as it happens
        print(f"  failed: {kind} {path}: {detail}", file=sys.stderr, flush=True)
    result.add(kind, outcome, detail, planned_cancel=cancel_after is not None)


async def run_soak(base: str, spec: SoakSpec, read_rss_mib: Callable[[], float] | None = None,
                   model: str | None = None, progress: bool = False) -> SoakResult:
    """Send `spec.requests` mixed requests with `spec.concurrency` in flight; check the books."""
    rng = random.Random(spec.seed)
    result = SoakResult()
    warm_at = max(1, int(spec.requests * spec.warmup_fraction))
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0, connect=30.0),
                                 limits=httpx.Limits(max_connections=spec.concurrency + 8)) as client:
        model = model or (await client.get("/v1/models")).json()["data"][0]["id"]
        plan = []
        for _ in range(spec.requests):
            kind = rng.choices(KINDS, weights=(3, 2, 1, 1, 1, 1, 1, 1))[0]
            path, body, _ = _request(kind, rng, model)
            cancel = rng.uniform(0.0, 0.5) if rng.random() < spec.cancel_fraction else None
            plan.append((kind, path, body, cancel))
        queue: asyncio.Queue[tuple[str, str, Any, float | None]] = asyncio.Queue()
        for item in plan:
            queue.put_nowait(item)
        started = time.perf_counter()

        async def worker() -> None:
            while not queue.empty():
                item = queue.get_nowait()
                await _one(client, *item, result, log_failures=progress)
                if read_rss_mib is not None and result.rss_warm_mib is None and result.total >= warm_at:
                    result.rss_warm_mib = read_rss_mib()
                if progress and result.total % 500 == 0:
                    print(f"  {result.total}/{spec.requests} {dict(result.outcomes)}", file=sys.stderr, flush=True)

        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        result.seconds = time.perf_counter() - started
        for _ in range(600):  # cancels reach the engine within a step or two
            result.integrity = (await client.get("/debug/integrity")).json()
            if not result.integrity.get("requests_in_engine") and not result.integrity.get("blocks_held"):
                break
            await asyncio.sleep(0.05)
    if read_rss_mib is not None:
        result.rss_end_mib = read_rss_mib()
    return result


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prelude bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--cancel-fraction", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="soak a running server (RSS is then not checked)")
    p.add_argument("--json", default="bench_results/soak.json")
    p.add_argument("--tiny", action="store_true",
                   help="serve a tiny random-weight Llama with the default model's tokenizer and chat template "
                        "(the server's own work at many times the default model's request rate)")
    p.add_argument("server_args", nargs="*", help="extra `prelude serve` flags (after --)")
    args = p.parse_args(argv)
    spec = SoakSpec(args.requests, args.concurrency, args.cancel_fraction, args.seed)
    if args.url:
        result = asyncio.run(run_soak(args.url, spec, progress=True))
    else:
        from prelude.testing.random_model import tiny_llama_dir
        from prelude.bench.server_proc import free_port

        port = free_port()
        model = ["--model", str(tiny_llama_dir())] if args.tiny else []
        cmd = [sys.executable, "-m", "prelude.cli", "serve", "--port", str(port), "--log-level", "warning",
               *model, *args.server_args]
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(base, proc)
            result = asyncio.run(run_soak(base, spec, lambda: rss_mib(proc.pid), progress=True))
        finally:
            proc.terminate()
            code = proc.wait(timeout=60)
            log.close()
        print(f"server exit code after SIGTERM: {code}")
    summary = {"spec": asdict(spec), **result.summary(), "problems": result.verdict(spec)}
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1))
    for line in result.failures[:10]:
        print("  failure:", line)
    write_json(args.json, summary)
    return 0 if not summary["problems"] else 1


def _wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited before it was ready")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("server did not become ready")


if __name__ == "__main__":
    raise SystemExit(main())
