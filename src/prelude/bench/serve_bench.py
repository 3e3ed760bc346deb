"""`prelude bench serve`: Prelude and its peers on the same prompts, one run, ratios.

Scenarios (scaled down by --scale for 2-core machines):
  a) OneShot 128-in/1-out, c=1: E2E, TTFT, input tok/s, RPM, plus startup time to ready;
  b) 512-in/1-out sweep over concurrencies: req/s, P50/P95 E2E;
  c) decode control 128-in/32-out, c=4: TTFT, TPOT, output tok/s.
Peers: a plain `transformers` server (prelude.bench.peers.transformers_server) and
llama.cpp's server (llama-cpp-python, `--llama-python` names a Python that has it) on
the same GGUF; a peer that can not start is skipped with a message, never faked. The raw
forward of the same prompt in this process is the ceiling for (a).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx

from prelude.bench.results import write_json
from prelude.bench.server_proc import free_port, server_process


def prompt_of(tokens: int, rng: random.Random, tokenizer: Any) -> str:
    """Text whose encoding by the served model's tokenizer has about `tokens` tokens."""
    words = ("alpha beta gamma delta policy judge score rubric model token cache queue latency throughput "
             "evidence answer question context document relevant helpful").split()
    text = " ".join(rng.choice(words) for _ in range(tokens * 2))
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens])


async def _request(client: httpx.AsyncClient, base: str, model: str | None, prompt: str, max_tokens: int) -> dict[str, float]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"e2e": end - t0, "ttft": (first or end) - t0, "decode": end - (first or end)}


async def run_load(base: str, model: str | None, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list[dict[str, float]], float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await _request(client, base, model, "Warm up the server, please.", max_tokens)  # not a measured prompt

        async def worker() -> None:
            while not queue.empty():
                results.append(await _request(client, base, model, queue.get_nowait(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


@contextmanager
def start(name: str, args: argparse.Namespace) -> Iterator[tuple[str | None, float]]:
    """(base URL or None if the peer is unavailable, seconds to ready)."""
    port = free_port()
    if name == "prelude":
        cmd = [sys.executable, "-m", "prelude.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--dtype", args.dtype]
    elif name == "transformers":
        cmd = [sys.executable, "-m", "prelude.bench.peers.transformers_server", "--port", str(port), "--dtype", args.dtype]
    else:
        from prelude.model.loader import default_model_path

        if not args.llama_python:
            print("llama.cpp peer skipped: pass --llama-python with a Python that has llama-cpp-python[server]")
            yield None, 0.0
            return
        cmd = [args.llama_python, "-m", "llama_cpp.server", "--model", str(default_model_path()), "--port", str(port),
               "--host", "127.0.0.1", "--n_ctx", "2048", "--n_threads", "2"]
    t0 = time.perf_counter()
    ready_path = "/v1/models" if name == "llama.cpp" else "/health"  # llama-cpp-python has no /health
    try:
        with server_process(cmd, port, timeout_s=600, ready_path=ready_path) as base:
            yield base, time.perf_counter() - t0
    except (RuntimeError, TimeoutError) as exc:
        print(f"{name} skipped: {exc}")
        yield None, 0.0


def raw_forward_ms(tokens: list[int], dtype: str, iters: int) -> float:
    from prelude.bench.oneshot_bench import raw_forward_seconds

    box: list[list[float]] = []
    t = threading.Thread(target=lambda: box.append(raw_forward_seconds(tokens, dtype, iters)))
    t.start()
    t.join()
    return 1000 * statistics.median(box[0])


def run_scenarios(
    r: dict[str, Any], base: str, model: str | None, p128: list[str], p512: dict[int, list[str]], n_a: int,
    sweep: list[int],
) -> None:
    res, wall = asyncio.run(run_load(base, model, p128[:n_a], 1, 1))
    e2e = [x["e2e"] for x in res]
    r["a_oneshot_128_1_c1"] = {"e2e_p50_ms": 1000 * pct(e2e, 50), "e2e_p95_ms": 1000 * pct(e2e, 95),
                               "ttft_p50_ms": 1000 * pct([x["ttft"] for x in res], 50),
                               "input_tok_s": 128 * len(res) / wall, "rpm": 60 * len(res) / wall}
    r["b_sweep_512_1"] = {}
    for c in sweep:
        res, wall = asyncio.run(run_load(base, model, p512[c], 1, c))
        e2e = [x["e2e"] for x in res]
        r["b_sweep_512_1"][c] = {"req_s": len(res) / wall, "p50_ms": 1000 * pct(e2e, 50), "p95_ms": 1000 * pct(e2e, 95)}
    res, wall = asyncio.run(run_load(base, model, p128[n_a:], 32, 4))
    r["c_decode_128_32_c4"] = {"ttft_p50_ms": 1000 * pct([x["ttft"] for x in res], 50),
                               "tpot_p50_ms": 1000 * pct([x["decode"] / 31 for x in res], 50),
                               "output_tok_s": 32 * len(res) / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude bench serve")
    ap.add_argument("--peers", default="prelude,transformers,llama.cpp")
    ap.add_argument("--llama-python", default=None, help="a python with llama-cpp-python[server] installed")
    ap.add_argument("--scale", type=float, default=0.25, help="fraction of the paper's request counts")
    ap.add_argument("--sweep", default="1,4,16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default="bench_results/serve.json")
    args = ap.parse_args(argv)
    from prelude.model.loader import load_model_files

    tok = load_model_files(None).tokenizer
    rng = random.Random(0)
    n_a, n_b, n_c = max(5, int(100 * args.scale)), max(8, int(200 * args.scale)), max(8, int(400 * args.scale))
    p128 = [prompt_of(128, rng, tok) for _ in range(n_a + n_c)]
    sweep = [int(x) for x in args.sweep.split(",")]
    # Fresh prompts for every sweep point (the same ones for every peer), so no engine
    # can answer from a cache filled by an earlier point.
    p512 = {c: [prompt_of(512, rng, tok) for _ in range(n_b)] for c in sweep}
    out: dict[str, Any] = {"scale": args.scale, "dtype": args.dtype, "peers": {}}
    for name in args.peers.split(","):
        with start(name, args) as (base, ready_s):
            if base is None:
                continue
            model = "SmolLM2-135M-Instruct" if name == "prelude" else None
            r: dict[str, Any] = {"startup_s": ready_s}
            try:
                run_scenarios(r, base, model, p128, p512, n_a, sweep)
            except httpx.HTTPError as exc:  # a peer that breaks mid-run is reported, not hidden
                r["error"] = f"{type(exc).__name__}: {exc}"
                print(f"{name} failed: {r['error']}")
            out["peers"][name] = r
            print(name, json.dumps(r), flush=True)
    ids = tok.encode(p128[0], add_special_tokens=False)
    out["raw_forward_128_ms"] = raw_forward_ms(ids, args.dtype, 20)
    pre = out["peers"].get("prelude")
    if pre:
        e2e = pre["a_oneshot_128_1_c1"]["e2e_p50_ms"]
        out["ratios"] = {"prelude_e2e_over_raw": e2e / out["raw_forward_128_ms"]}
        for peer, r in out["peers"].items():
            if peer != "prelude" and "error" not in r:
                out["ratios"][f"{peer}_e2e_over_prelude"] = r["a_oneshot_128_1_c1"]["e2e_p50_ms"] / e2e
                out["ratios"][f"prelude_decode_tok_s_over_{peer}"] = (
                    pre["c_decode_128_32_c4"]["output_tok_s"] / r["c_decode_128_32_c4"]["output_tok_s"])
    print(json.dumps(out.get("ratios", {}), indent=2))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
