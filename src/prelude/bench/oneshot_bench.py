"""`prelude bench oneshot`: what the OneShot class buys, measured side by side.

- 128-in/1-out at concurrency 1 through HTTP on two servers started by this command:
  the normal one (OneShot) and one with --force-decode-path (every request takes the
  Decode path), requests interleaved; their E2E ratio.
- The raw forward of the same prompt (trunk + last-token logits, no server) in this
  process: the machine's ceiling, and E2E / raw.
- Classification (label tokens) and embeddings items/s at concurrency 16, 20 texts
  per request.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx
import torch

from prelude.bench.ceiling import raw_forward_seconds
from prelude.bench.results import write_json
from prelude.bench.server_proc import prelude_server

TEXT = (
    "Prelude serves judges, routers, classifiers, reward models, rerankers and embeddings next to chat. "
    "A decision-style request reads a prompt and returns a fixed-size artifact after one forward pass. "
)


def _prompt_ids(n: int) -> list[int]:
    from prelude.model.loading.files import load_model_files

    tok = load_model_files(None).tokenizer
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(tok.encode(TEXT, add_special_tokens=False))
    return ids[:n]


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "mean_ms": 1000 * statistics.fmean(s),
        "p50_ms": 1000 * s[len(s) // 2],
        "p90_ms": 1000 * s[min(len(s) - 1, int(0.9 * len(s)))],
        "n": len(s),
    }


def latency_pair(bases: dict[str, str], ids: list[int], iters: int) -> dict[str, list[float]]:
    """Interleaved 128-in/1-out requests at concurrency 1 against each server."""
    out: dict[str, list[float]] = {k: [] for k in bases}
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        for i in range(iters + 3):
            for name, base in bases.items():
                t0 = time.perf_counter()
                r = client.post(base + "/v1/completions", json=body)
                dt = time.perf_counter() - t0
                r.raise_for_status()
                if i >= 3:
                    out[name].append(dt)
    return out


async def _items_per_second(base: str, path: str, make_body: Any, concurrency: int, requests: int, items: int) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        await client.post(base + path, json=make_body(0))  # warm-up
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                r = await client.post(base + path, json=make_body(i))
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return requests * items / (time.perf_counter() - t0)


def _texts(i: int, n: int) -> list[str]:
    return [f"Item {i}-{j}: is this support ticket about billing? The customer says the invoice {j} is wrong."
            for j in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude bench oneshot")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--requests", type=int, default=32, help="requests per throughput run")
    ap.add_argument("--json", default="bench_results/oneshot.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    ids = _prompt_ids(128)
    # The same prompt repeats: without this the prefix cache would answer most of it and
    # the comparison with a full raw forward would be meaningless.
    common = ["--dtype", args.dtype, "--no-enable-prefix-caching"]
    with prelude_server(common) as oneshot, prelude_server([*common, "--force-decode-path"]) as forced:
        lat = latency_pair({"oneshot": oneshot, "forced_decode": forced}, ids, args.iters)
        n_items = 20
        classify = asyncio.run(_items_per_second(
            oneshot, "/classify", lambda i: {"input": _texts(i, n_items), "labels": ["yes", "no"]},
            16, args.requests, n_items))
        embed = asyncio.run(_items_per_second(
            oneshot, "/v1/embeddings", lambda i: {"input": _texts(i, n_items)}, 16, args.requests, n_items))
        classify_forced = asyncio.run(_items_per_second(
            forced, "/classify", lambda i: {"input": _texts(i, n_items), "labels": ["yes", "no"]},
            16, args.requests, n_items))
    raw = raw_forward_seconds(ids, args.dtype, args.iters)
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "prompt_tokens": len(ids),
        "latency_128in_1out_c1": {k: _stats(v) for k, v in lat.items()},
        "raw_forward": _stats(raw),
        "ratio_forced_decode_over_oneshot": statistics.fmean(lat["forced_decode"]) / statistics.fmean(lat["oneshot"]),
        "ratio_e2e_over_raw_forward": statistics.fmean(lat["oneshot"]) / statistics.fmean(raw),
        "classify_items_per_s_c16_20_per_request": classify,
        "classify_items_per_s_forced_decode": classify_forced,
        "embed_items_per_s_c16_20_per_request": embed,
        "threads": torch.get_num_threads(),
    }
    print(f"{'128-in/1-out, c=1':<40}{'mean ms':>10}{'p50 ms':>10}{'p90 ms':>10}")
    for name, st in [("OneShot E2E (HTTP)", result["latency_128in_1out_c1"]["oneshot"]),
                     ("forced-Decode E2E (HTTP)", result["latency_128in_1out_c1"]["forced_decode"]),
                     ("raw forward (in process)", result["raw_forward"])]:
        print(f"{name:<40}{st['mean_ms']:>10.1f}{st['p50_ms']:>10.1f}{st['p90_ms']:>10.1f}")
    print(f"forced-Decode / OneShot: {result['ratio_forced_decode_over_oneshot']:.3f}x   "
          f"OneShot E2E / raw forward: {result['ratio_e2e_over_raw_forward']:.3f}x")
    print(f"classify items/s (c=16, 20/request): {classify:.1f} (forced-Decode: {classify_forced:.1f})   "
          f"embed items/s: {embed:.1f}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
