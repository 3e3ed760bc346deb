"""`prelude bench serve --device cuda`: the Prelude paper's GPU scenarios on random-weight
Qwen3-0.6B / Qwen3-4B shapes (no hub), next to HF `transformers` on the same GPU and the
machine's floor (the same forward replayed from a CUDA graph: no server, no scheduler).

(a) 0.6B, 128-in/1-out, c=1, over HTTP, peers alternated request by request;
(b) 4B, 512-in/1-out, a concurrency sweep, against the batched-forward ceiling measured
    in the same run;
(c) 0.6B, 128-in/32-out, c=4 (output tok/s, TPOT).
Start-up to ready (graph capture included) is timed for every server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from prelude.bench.loadgen import LoadSpec, completion_sender, percentile, run_load, summarize
from prelude.bench.peers.launch import path_first
from prelude.bench.prompts import exact_prompt
from prelude.testing.random_model import random_model_dir
from prelude.bench.results import write_json
from prelude.bench.server_proc import free_port, server_process

GOALS = {"a_e2e_p50_ms": 4.0, "a_over_floor_ms": 1.5, "b_peak_req_s": 186.7, "b_over_ceiling": 0.9,
         "c_output_tok_s": 1474.0, "c_tpot_ms": 2.1, "startup_s": 5.0}


def _prelude_cmd(model_dir: Path, port: int, device: str, backend: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "prelude.cli", "serve", "--model", str(model_dir), "--port", str(port),
            "--log-level", "warning", "--device", device, "--attention-backend", backend,
            "--max-num-seqs", "256", "--max-num-batched-tokens", "16384", "--max-model-len", "2048", *extra]


def _transformers_cmd(model_dir: Path, port: int, device: str) -> list[str]:
    return [sys.executable, "-m", "prelude.bench.peers.transformers_server", "--port", str(port),
            "--model", str(model_dir), "--device", device]


class _Server:
    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.port, self.env = name, cmd, port, env
        self.startup_s = 0.0
        self._ctx: Any = None
        self.base = ""

    def __enter__(self) -> "_Server":
        t0 = time.perf_counter()
        self._ctx = server_process(self.cmd, self.port, timeout_s=900, env=self.env)
        self.base = self._ctx.__enter__()
        self.startup_s = time.perf_counter() - t0
        print(f"[{self.name}] ready in {self.startup_s:.2f} s", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def baseline_env(baseline_src: str) -> dict[str, str]:
    """The environment of peer prelude-base: `baseline_src` (another checkout's src folder)
    first on the path, so its `prelude` is imported; the rest of the path (carried wheels) kept."""
    if not os.path.isdir(os.path.join(baseline_src, "prelude")):
        raise SystemExit(f"--baseline-src {baseline_src} holds no prelude package")
    return {**os.environ, "PYTHONPATH": path_first(os.path.abspath(baseline_src))}


def graph_floor(model_dir: Path, device: str, backend: str, prompt_ids: list[list[int]], iters: int) -> dict[str, Any]:
    """The forward alone (replayed from its CUDA graph bucket where one fits): per-prompt
    p50 for one 128-token row and requests/s of batched 512-token rows."""
    from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
    from prelude.engine.engine import LLMEngine
    from prelude.forward_batch import OneShotBatch, OneShotRow, SampleSpec
    from prelude.params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), executor=ExecutorConfig(device=device, attention_backend=backend),
        cache=CacheConfig(kv_cache_memory_gib=1.0), scheduler=SchedulerConfig(max_model_len=2048)))
    runner = engine.runner

    def timed(rows: list[OneShotRow]) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():  # the serving trunk (rows that sample: the last position is read)
            hidden = runner.trunk(OneShotBatch(tuple(rows)))[0]
            runner.model.compute_logits(hidden[-1:]).argmax(-1).cpu()
        return time.perf_counter() - t0

    out: dict[str, Any] = {}
    for name, ids in (("short", prompt_ids[:1]), ("batched", prompt_ids)):
        rows = [OneShotRow(f"f{i}", p, SampleSpec(SamplingParams(temperature=0.0), p, []), None)
                for i, p in enumerate(ids)]
        for _ in range(3):
            timed(rows)
        times = [timed(rows) for _ in range(iters)]
        out[f"{name}_p50_ms"] = 1000 * statistics.median(times)
        out[f"{name}_rows"] = len(rows)
    return out


def _prompts(tok: Any, n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [exact_prompt(length, rng, tok) for _ in range(n)]


async def _alternate(servers: list[_Server], prompts: list[str], warm: str) -> dict[str, Any]:
    senders = {s.name: (s, completion_sender(s.base, None, 1)) for s in servers}
    records: dict[str, list[Any]] = {s.name: [] for s in servers}
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0)) as client:
        for _, send in senders.values():
            for _ in range(3):
                await send(client, warm)
        for p in prompts:
            for name, (_, send) in senders.items():
                records[name].append(await send(client, p))
    out = {}
    for name, rs in records.items():
        e2e = [r.e2e_s for r in rs if r.ok]
        out[name] = {"e2e_p50_ms": 1000 * percentile(e2e, 50), "e2e_p95_ms": 1000 * percentile(e2e, 95),
                     "errors": sum(not r.ok for r in rs), "requests": len(rs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude bench serve --device cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--scenarios", default="a,b,c")
    ap.add_argument("--peers", default="prelude,transformers",
                    help="prelude, prelude-base (the same from --baseline-src: old vs new), "
                         "prelude-unfused (--no-fused-kernels, for (a) and (c)), transformers")
    ap.add_argument("--baseline-src", default=None, help="peer prelude-base: the src folder of another checkout")
    ap.add_argument("--small", default="qwen3-0.6b", help="shape for (a) and (c)")
    ap.add_argument("--large", default="qwen3-4b", help="shape for (b)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--sweep", default="1,16,64,96,128,192")
    ap.add_argument("--out", default="bench_results/serve_gpu")
    ap.add_argument("--extra", default="", help="extra `prelude serve` flags")
    args = ap.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    peers = args.peers.split(",")
    result: dict[str, Any] = {"command": "prelude bench serve " + " ".join(argv or sys.argv[1:]),
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else args.device,
                              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "startup_s": {}}
    for shape, wanted in ((args.small, {"a", "c"}), (args.large, {"b"})):
        todo = wanted & scenarios
        if not todo:
            continue
        model_dir = random_model_dir(shape)
        from prelude.tokenizer.loading import load_tokenizer

        tok = load_tokenizer(model_dir)
        servers = []
        if "prelude" in peers:
            servers.append(_Server("prelude", _prelude_cmd(model_dir, free_port(), args.device, args.attention_backend,
                                                           args.extra.split()), 0))
        if "prelude-base" in peers:
            if args.baseline_src is None:
                raise SystemExit("peer prelude-base needs --baseline-src")
            servers.append(_Server("prelude-base", _prelude_cmd(model_dir, free_port(), args.device,
                                                                args.attention_backend, args.extra.split()), 0,
                                   baseline_env(args.baseline_src)))
        if "prelude-unfused" in peers and todo & {"a", "c"}:  # the fused kernels' A/B, in the same run
            servers.append(_Server("prelude-unfused", _prelude_cmd(
                model_dir, free_port(), args.device, args.attention_backend, [*args.extra.split(), "--no-fused-kernels"]), 0))
        if "transformers" in peers and todo & {"a", "c"}:
            servers.append(_Server("transformers", _transformers_cmd(model_dir, free_port(), args.device), 0))
        for s in servers:
            s.port = int(s.cmd[s.cmd.index("--port") + 1])
        started: list[_Server] = []
        try:
            for s in servers:  # one after another: each start-up timed alone
                started.append(s.__enter__())
                result["startup_s"][f"{s.name}:{shape}"] = s.startup_s
            short = _prompts(tok, args.requests, 128, 1)
            if "a" in todo:
                result["a"] = asyncio.run(_alternate(started, short, short[0]))
                result["a"]["floor"] = graph_floor(model_dir, args.device, args.attention_backend,
                                                   [tok.encode(short[0], add_special_tokens=False)], 50)
                print("[a]", result["a"], flush=True)
            if "c" in todo:
                result["c"] = {}
                for s in started:
                    res = asyncio.run(run_load(completion_sender(s.base, None, 32), short[:64], LoadSpec(4, warmup=4)))
                    result["c"][s.name] = summarize(res, 128)
                    # in completion order: whether slow first tokens cluster (start-up work) or recur
                    result["c"][s.name]["ttft_ms_by_completion"] = [round(1000 * r.ttft_s, 2) for r in res.records]
                print("[c]", result["c"], flush=True)
            if "b" in todo:
                sweep = [int(x) for x in args.sweep.split(",")]
                # each point its own prompts: one a server has seen is a prefix-cache hit
                sizes = [max(c * 4, 64) for c in sweep]
                long = _prompts(tok, 64 + sum(sizes), 512, 2)
                ids = [tok.encode(p, add_special_tokens=False) for p in long[:64]]
                ceiling = graph_floor(model_dir, args.device, args.attention_backend, ids, 10)
                result["b"] = {"ceiling_req_s": 1000 * ceiling["batched_rows"] / ceiling["batched_p50_ms"], "points": {}}
                swept = [s for s in started if s.name in ("prelude", "prelude-base")]
                for i, c in enumerate(sweep):
                    point = long[64 + sum(sizes[:i]) : 64 + sum(sizes[: i + 1])]
                    # old and new alternate point by point, the first of each pair swapped each point
                    for s in swept[::-1] if i % 2 else swept:
                        res = asyncio.run(run_load(completion_sender(s.base, None, 1), point, LoadSpec(c)))
                        key = "points" if s.name == "prelude" else f"points:{s.name}"
                        result["b"].setdefault(key, {})[str(c)] = summarize(res, 512)
                        print(f"[b] {s.name} c={c}", result["b"][key][str(c)]["req_s"], flush=True)
        finally:
            for s in reversed(started):
                s.__exit__(None, None, None)
    result["goals"] = gpu_goals(result)
    for g in result["goals"]:
        print(f"{g['goal']}: {g['value']} ({g['status']})")
    write_json(Path(args.out).with_suffix(".json"), result)
    return 0


def gpu_goals(r: dict[str, Any]) -> list[dict[str, str]]:
    """Issue 11's goals against one run's figures ('met', 'short' or 'not run')."""
    goals: list[dict[str, str]] = []

    def add(goal: str, value: float | None, ok: bool) -> None:
        goals.append({"goal": goal, "value": "n/a" if value is None else f"{value:.2f}",
                      "status": "not run" if value is None else ("met" if ok else "short")})

    a = r.get("a", {}).get("prelude")
    e2e = a["e2e_p50_ms"] if a else None
    add("(a) E2E p50 <= 4.0 ms", e2e, e2e is not None and e2e <= GOALS["a_e2e_p50_ms"])
    floor = r.get("a", {}).get("floor", {}).get("short_p50_ms")
    over = e2e - floor if e2e is not None and floor is not None else None
    add("(a) E2E - graph floor <= 1.5 ms", over, over is not None and over <= GOALS["a_over_floor_ms"])
    b = r.get("b")
    peak = max((p["req_s"] for p in b["points"].values()), default=None) if b else None
    add("(b) peak req/s >= 186.7", peak, peak is not None and peak >= GOALS["b_peak_req_s"])
    ratio = peak / b["ceiling_req_s"] if peak is not None and b else None
    add("(b) peak >= 0.9x batched ceiling", ratio, ratio is not None and ratio >= GOALS["b_over_ceiling"])
    c = r.get("c", {}).get("prelude")
    add("(c) output tok/s >= 1,474", c["output_tok_s"] if c else None, bool(c) and c["output_tok_s"] >= 1474)
    add("(c) TPOT p50 <= 2.1 ms", c["tpot_p50_ms"] if c else None, bool(c) and c["tpot_p50_ms"] <= 2.1)
    start = [v for k, v in r.get("startup_s", {}).items() if k.startswith("prelude:") and "0.6b" in k]
    add("start-up to ready <= 5 s (0.6B)", start[0] if start else None, bool(start) and start[0] <= 5.0)
    return goals


if __name__ == "__main__":
    raise SystemExit(main())
