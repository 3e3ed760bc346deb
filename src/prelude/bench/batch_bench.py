"""`prelude bench batch`: a judge file (one shared rubric + short items, 1 output token)
through `prelude run-batch`, through `prelude serve` at a sweep of concurrencies, and
through vLLM's run_batch; the latency of interactive requests while a /v1/batches job
runs on the server; and the RSS of a long embeddings job. Prints the figures,
writes JSON and a PNG.

Job time is from the job's start to its last answer, without the model load: run-batch's
own summary, the first to last request against the server, and vLLM's "Reading batch"
to "Writing outputs" log lines (its process wall, start-up included, is kept beside)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

MODEL_NAME = "SmolLM2-135M-Instruct"
_WORDS = ("accuracy relevance evidence claim answer score rubric criterion reasoning fluent concise correct "
          "complete helpful harmless honest source citation detail example context summary fact error").split()


def _tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _text_of_tokens(tok: Any, n: int, rng: random.Random) -> str:
    """A text of about `n` tokens (random words, cut on a token boundary)."""
    words = " ".join(rng.choice(_WORDS) for _ in range(n * 2))
    ids = tok.encode(words, add_special_tokens=False).ids[:n]
    return tok.decode(ids)


def judge_file(path: Path, model_dir: Path, lines: int, rubric_tokens: int, item_tokens: int, seed: int = 0,
               rubrics: int = 1) -> Path:
    """`rubrics` > 1: that many rubrics (one preamble, their own criteria), line i judged by
    rubric i mod `rubrics`: interleaved, as a file concatenated from several evaluations."""
    tok = _tokenizer(model_dir)
    rng = random.Random(seed)
    preamble = "You are a strict judge. Grade the answer below. "
    texts = [preamble + _text_of_tokens(tok, rubric_tokens, rng) for _ in range(rubrics)]
    with open(path, "w") as f:
        for i in range(lines):
            body = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "system", "content": texts[i % rubrics]},
                                 {"role": "user", "content": f"Item {i}: " + _text_of_tokens(tok, item_tokens, rng)}]}
            f.write(json.dumps({"custom_id": f"judge-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    return path


def embeddings_file(path: Path, lines: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(lines):
            text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24)))
            f.write(json.dumps({"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": MODEL_NAME, "input": text}}) + "\n")
    return path


class _Watched:
    """A subprocess whose stderr lines are kept with the time each arrived."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, bufsize=1)
        self.lines: list[tuple[float, str]] = []
        self.peak_rss_kib = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # tqdm's carriage returns split into lines too
            for part in line.rstrip().split("\r"):
                self.lines.append((time.monotonic() - self.t0, part))

    def wait(self) -> float:
        while self.proc.poll() is None:
            self._sample_rss()
            time.sleep(0.2)
        self._reader.join(timeout=5)
        return time.monotonic() - self.t0

    def _sample_rss(self) -> None:
        try:
            for row in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if row.startswith("VmRSS:"):
                    self.peak_rss_kib = max(self.peak_rss_kib, int(row.split()[1]))
        except (OSError, ValueError):
            pass

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if re.search(pattern, line)), None)


def run_prelude_batch(inp: Path, out: Path, flags: list[str]) -> dict[str, Any]:
    w = _Watched([sys.executable, "-m", "prelude.cli", "run-batch", "-i", str(inp), "-o", str(out),
                  "--no-progress", "--log-level", "warning", *flags])
    wall = w.wait()
    hit = w.first(r"lines run .* in ([0-9.]+) s")
    if w.proc.returncode not in (0, 1) or hit is None:
        raise RuntimeError("run-batch failed: " + "\n".join(line for _, line in w.lines[-20:]))
    job_s = float(re.search(r" in ([0-9.]+) s \(", hit[1]).group(1))
    return {"process_wall_s": wall, "job_s": job_s, "summary": hit[1], "exit": w.proc.returncode}


def run_vllm_batch(python: str, inp: Path, out: Path, model_dir: Path, dtype: str) -> dict[str, Any]:
    from prelude.bench.peers.launch import avx2_cap_env

    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.pop("PYTHONPATH", None)
    env.update(avx2_cap_env(inherit=False))  # under the AVX2 cap: vLLM's AVX2 kernels, as serve's peer
    w = _Watched([python, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(inp), "-o", str(out),
                  "--model", str(model_dir), "--served-model-name", MODEL_NAME, "--dtype", dtype], env=env)
    wall = w.wait()
    # The job: its progress bar's own elapsed time at 100% (else the log lines around it).
    done = w.first(r"Running batch: 100% .*\[(\d+):(\d+)<")
    start = w.first(r"Reading batch from|Running batch:\s+0%")
    end = w.first(r"Writing outputs to") or done
    if done is None and (start is None or end is None):
        raise RuntimeError("vLLM run_batch failed: " + "\n".join(line for _, line in w.lines[-20:]))
    if done is not None:
        minutes, seconds = re.search(r"\[(\d+):(\d+)<", done[1]).groups()
        job_s = 60 * int(minutes) + int(seconds)
    else:
        job_s = end[0] - start[0]
    return {"process_wall_s": wall, "job_s": float(job_s), "startup_s": start[0] if start else None,
            "exit": w.proc.returncode}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _send_all(base: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[float, int]:
    """(seconds, failed requests) of every body POSTed at `concurrency`, through the lean
    client (bench/raw_http.py): httpx's CPU a request would be taken from the server."""
    from prelude.bench.raw_http import RawPool, raw_json_sender

    send = raw_json_sender("/v1/chat/completions", lambda body: body, lambda _: 1)
    slots = asyncio.Semaphore(concurrency)
    async with RawPool(base) as pool:

        async def one(body: dict[str, Any]) -> bool:
            async with slots:
                return (await send(pool, body)).ok

        t0 = time.monotonic()
        oks = await asyncio.gather(*(one(b) for b in bodies))
        return time.monotonic() - t0, oks.count(False)


def _start_server(flags: list[str], extra: list[str] = ()) -> tuple[_Watched, str]:
    import httpx

    port = _free_port()
    w = _Watched([sys.executable, "-m", "prelude.cli", "serve", "--port", str(port), "--log-level", "warning",
                  *extra, *flags])
    base = f"http://127.0.0.1:{port}"
    for _ in range(2400):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return w, base
        except httpx.HTTPError:
            pass
        if w.proc.poll() is not None:
            break
        time.sleep(0.25)
    _stop(w)
    raise RuntimeError("prelude serve did not come up: " + "\n".join(line for _, line in w.lines[-20:]))


def _stop(w: _Watched) -> None:
    w.proc.terminate()
    try:
        w.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        w.proc.kill()


def run_serve(inp: Path, flags: list[str], concurrency: int) -> dict[str, Any]:
    """The file's bodies against a fresh `prelude serve` (a server that ran them before
    would find every item in its prefix cache) at one concurrency."""
    w, base = _start_server(flags)
    try:
        bodies = [json.loads(line)["body"] for line in inp.read_text().splitlines()]
        job_s, errors = asyncio.run(_send_all(base, bodies, concurrency))
        return {"job_s": job_s, "req_s": len(bodies) / job_s, "errors": errors}
    finally:
        _stop(w)


def _interactive_e2e(base: str, prompts: list[str]) -> list[float]:
    """c=1: each 128/1 request after the previous answer; seconds per request (one output
    token, so this is the TTFT plus one detokenize)."""
    import httpx

    times = []
    with httpx.Client(timeout=600) as client:
        for prompt in prompts:
            t0 = time.monotonic()
            r = client.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            times.append(time.monotonic() - t0)
    return times


def run_ttft(judge: Path, model_dir: Path, flags: list[str], requests: int, batch_dir: Path) -> dict[str, Any]:
    """Interactive 128/1 c=1 latency on an idle server, then while a /v1/batches job of the
    judge file runs on it, then idle again (the batch cancelled)."""
    import httpx

    tok = _tokenizer(model_dir)
    rng = random.Random(1)
    prompts = [_text_of_tokens(tok, 128, rng) for _ in range(3 * requests)]
    w, base = _start_server(flags, ["--batch-dir", str(batch_dir)])
    try:
        _interactive_e2e(base, prompts[:2])  # warm-up
        idle = _interactive_e2e(base, prompts[:requests])
        with open(judge, "rb") as f:
            fid = httpx.post(base + "/v1/files", files={"file": ("judge.jsonl", f)}, data={"purpose": "batch"},
                             timeout=600).json()["id"]
        batch = httpx.post(base + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                        "completion_window": "24h"}, timeout=60).json()
        while True:  # the batch is running and has answered a line: the rubric is hot, the engine busy
            state = httpx.get(f"{base}/v1/batches/{batch['id']}", timeout=60).json()
            if state["request_counts"]["completed"] >= 1 or state["status"] not in ("validating", "in_progress"):
                break
            time.sleep(0.2)
        before = state["request_counts"]["completed"]
        busy = _interactive_e2e(base, prompts[requests:2 * requests])
        after = httpx.get(f"{base}/v1/batches/{batch['id']}", timeout=60).json()
        httpx.post(f"{base}/v1/batches/{batch['id']}/cancel", timeout=60)
        while httpx.get(f"{base}/v1/batches/{batch['id']}", timeout=60).json()["status"] not in (
                "cancelled", "completed", "failed"):
            time.sleep(0.2)
        idle_after = _interactive_e2e(base, prompts[2 * requests:])
    finally:
        _stop(w)
    med = statistics.median
    idle_ms = med(idle + idle_after) * 1000
    busy_ms = med(busy) * 1000
    return {"idle_ms": [t * 1000 for t in idle], "busy_ms": [t * 1000 for t in busy],
            "idle_after_ms": [t * 1000 for t in idle_after], "idle_p50_ms": idle_ms, "busy_p50_ms": busy_ms,
            "ratio": busy_ms / idle_ms, "batch_status_during": after["status"],
            "batch_lines_done_during": after["request_counts"]["completed"] - before}


def rss_job(inp: Path, out: Path, flags: list[str]) -> dict[str, Any]:
    """Peak RSS of a run-batch job against the RSS it had when its first answer was written
    (model loaded, engine warm): the growth a long job adds."""
    out.unlink(missing_ok=True)  # the first answer is this run's
    w = _Watched([sys.executable, "-m", "prelude.cli", "run-batch", "-i", str(inp), "-o", str(out),
                  "--no-progress", "--log-level", "warning", *flags])
    baseline = None
    samples = []
    while w.proc.poll() is None:
        w._sample_rss()
        if baseline is None and out.exists() and out.stat().st_size > 0:
            baseline = w.peak_rss_kib
        samples.append(w.peak_rss_kib)
        time.sleep(0.2)
    wall = w.wait()
    hit = w.first(r"lines run")
    return {"process_wall_s": wall, "rss_at_first_answer_mib": (baseline or 0) / 1024,
            "peak_rss_mib": w.peak_rss_kib / 1024, "growth_mib": (w.peak_rss_kib - (baseline or 0)) / 1024,
            "summary": hit[1] if hit else None}


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(result["judge"])
    rates = [point["req_s"] for point in result["judge"].values()]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(names, rates)
    ax.set_xlabel("judge lines / s (job time, model load excluded; median of rounds)")
    ax.set_title(f"{result['lines']} judge lines: {result['rubric_tokens']}-token rubric + "
                 f"{result['item_tokens']}-token items, 1 output token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from prelude.model.loading.files import load_model_files

    ap = argparse.ArgumentParser(prog="prelude bench batch", description=__doc__)
    ap.add_argument("--lines", type=int, default=10_000, help="judge lines")
    ap.add_argument("--rubric-tokens", type=int, default=1024)
    ap.add_argument("--item-tokens", type=int, default=64)
    ap.add_argument("--rubrics", type=int, default=1, help="judge: distinct rubrics, interleaved line by line")
    ap.add_argument("--which", default="run-batch,serve,vllm", help="any of run-batch, serve, vllm, ttft, rss")
    ap.add_argument("--concurrency", default="16,64", help="serve: the concurrencies swept (the best counts); "
                    "each point on a fresh server, so no point finds the items cached by another")
    ap.add_argument("--rounds", type=int, default=1, help="alternated rounds of every judge run (medians reported)")
    ap.add_argument("--ttft-requests", type=int, default=8, help="ttft: interactive requests per phase")
    ap.add_argument("--rss-lines", type=int, default=100_000, help="rss: embeddings lines")
    ap.add_argument("--dtype", default="auto",
                    help="every runner's dtype; auto: what `prelude serve` picks on this machine (bf16 only on CPUs "
                         "with AVX512-BF16/AMX), vLLM given the same")
    ap.add_argument("--vllm-python", default="/tmp/vllmvenv/bin/python")
    ap.add_argument("--out", default="bench_results/batch")
    ap.add_argument("--flags", default="", help="extra flags for prelude run-batch and serve")
    ap.add_argument("--free-model", action="store_true",
                    help="run Prelude on a 2-layer random model with the default model's tokenizer (a forward costs "
                         "~nothing): what is timed is the path around the engine, as on a fast GPU")
    args = ap.parse_args(argv)
    if args.dtype == "auto":  # resolved here so vLLM runs in the dtype Prelude picks (it has no such rule)
        import torch

        from prelude.executor.device import auto_dtype

        args.dtype = str(auto_dtype(torch.device("cpu"))).removeprefix("torch.")
    which = set(args.which.split(","))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = load_model_files(None).model_dir
    flags = ["--dtype", args.dtype, *args.flags.split()]
    served_dir = model_dir  # the weights every runner serves (the judge file needs only the tokenizer)
    if args.free_model:
        from prelude.testing.random_model import free_model_dir

        served_dir = free_model_dir()
        flags += ["--model", str(served_dir), "--served-model-name", MODEL_NAME]
    result: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                              "lines": args.lines, "rubrics": args.rubrics, "rubric_tokens": args.rubric_tokens, "item_tokens": args.item_tokens,
                              "dtype": args.dtype, "free_model": args.free_model, "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
                              "judge": {}}
    if which & {"run-batch", "serve", "vllm", "ttft"}:
        judge = judge_file(out / "judge.jsonl", model_dir, args.lines, args.rubric_tokens, args.item_tokens,
                           rubrics=args.rubrics)
    # Alternated rounds (run-batch, then serve at each concurrency, then vLLM), medians:
    # on a shared machine the load drifts between runs.
    samples: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):
        runs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
        if "run-batch" in which:
            runs.append(("run-batch", lambda: run_prelude_batch(judge, out / "judge.prelude.jsonl", flags)))
        if "serve" in which:
            for c in concurrencies:
                runs.append((f"serve c={c}", lambda c=c: run_serve(judge, flags, c)))
        if "vllm" in which:
            runs.append(("vllm run_batch", lambda: run_vllm_batch(args.vllm_python, judge, out / "judge.vllm.jsonl",
                                                                  served_dir, args.dtype)))
        for name, run in runs:
            r = run()
            r["req_s"] = args.lines / r["job_s"]
            r["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
            samples.setdefault(name, []).append(r)
            print(f"  round {round_ + 1} {name}: {r['req_s']:.2f} req/s ({r['job_s']:.1f} s job; load {r['loadavg'][0]})",
                  flush=True)
    for name, runs in samples.items():
        result["judge"][name] = {"req_s": statistics.median(r["req_s"] for r in runs),
                                 "job_s": statistics.median(r["job_s"] for r in runs), "runs": runs}
    if "ttft" in which:
        r = run_ttft(judge, model_dir, flags, args.ttft_requests, out / "batch-dir")
        result["interactive_ttft"] = r
        print(f"  interactive 128/1 c=1 while a batch runs: p50 {r['busy_p50_ms']:.0f} ms vs idle "
              f"{r['idle_p50_ms']:.0f} ms ({r['ratio']:.2f}x; {r['batch_lines_done_during']} batch lines answered "
              "meanwhile)", flush=True)
    if "rss" in which:
        emb = embeddings_file(out / "embeddings.jsonl", args.rss_lines)
        r = rss_job(emb, out / "embeddings.out.jsonl", flags)
        result["embeddings_rss"] = r
        print(f"  embeddings x{args.rss_lines}: RSS {r['rss_at_first_answer_mib']:.0f} MiB at the first answer, "
              f"peak {r['peak_rss_mib']:.0f} MiB (+{r['growth_mib']:.1f} MiB); {r['summary']}", flush=True)
    result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    best_serve = max((p["req_s"] for name, p in result["judge"].items() if name.startswith("serve")), default=None)
    rb = result["judge"].get("run-batch", {}).get("req_s")
    vl = result["judge"].get("vllm run_batch", {}).get("req_s")
    for name, point in result["judge"].items():
        print(f"  median of {len(point['runs'])}: {name} {point['req_s']:.2f} req/s")
    if rb and best_serve:
        result["run_batch_over_best_serve"] = rb / best_serve
        print(f"  run-batch / best serve: {rb / best_serve:.2f}x")
    if rb and vl:
        result["run_batch_over_vllm"] = rb / vl
        print(f"  run-batch / vLLM run_batch: {rb / vl:.2f}x")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    if result["judge"]:
        _plot(result, out / "judge.png")
    print(f"wrote {out / 'result.json'}; load average before {result['loadavg_before']}, after {result['loadavg_after']}")
    return 0
