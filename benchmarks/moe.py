"""The mixture-of-experts layers of Qwen3-30B-A3B cut to 4 layers (random bf16 weights at the
published shapes: hidden 2048, 128 experts, top-8, moe_intermediate_size 768,
norm_topk_prob), on the CPU: the experts on moe_experts.c ("new") against torch's grouped
F.linear path ("old"), within one run, on the same weights.

- memory bandwidth: the best read rate of a 1 GiB buffer, read in 64 MiB chunks (numpy,
  one thread and two), the figure decode is held against;
- decode at c=1: tokens one at a time through the 4 layers (router, top-8, experts), on
  torch's thread count and on one thread, each layer's call timed alone. Bytes a
  token reads: the router's weight and the packed copies of the experts it chose, as the
  kernel reads them (each chosen expert's blocks once a step; tests/model/test_qwen3_moe.py
  and tests/kernels/test_moe_experts.py check that nothing else is read); against the
  active experts' own bytes (3 x hidden x intermediate x 2 an expert): the ratio, and the
  GB/s the time gives against the measured bandwidth;
- prefill: `--prefill` tokens (512) through the 4 layers, tok/s, old and new.
Times are medians and minima of wall-clock rounds (the machine may be shared: its load
average is recorded; the prefill's process CPU time too, which a shared machine's wait
for a core does not count). Writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from prelude.model.layers.moe import SparseMoe

# Qwen3-30B-A3B's config.json (the MoE shapes are what count)
HIDDEN, EXPERTS, TOP_K, MOE_INTERMEDIATE, LAYERS = 2048, 128, 8, 768, 4


def memory_bandwidth(gib: float = 1.0, chunk_mib: int = 64, rounds: int = 6) -> dict[str, float]:
    """Best read GB/s of a buffer larger than the caches, a chunk at a time (numpy's dot of a
    chunk with itself: BLAS streams it with little work a byte), on 1 and 2 threads."""
    buf = np.ones(int(gib * (1 << 30)) // 4, dtype=np.float32)
    chunks = buf.reshape(-1, chunk_mib * (1 << 20) // 4)
    out: dict[str, float] = {}
    for threads in (1, 2):
        best = float("inf")
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for _ in range(rounds):
                for i in range(0, len(chunks) - threads + 1, threads):
                    part = chunks[i:i + threads]
                    t0 = time.perf_counter()
                    list(pool.map(lambda c: np.dot(c, c), part))
                    best = min(best, (time.perf_counter() - t0) / part.nbytes)
        out[f"read_gbs_{threads}_thread"] = 1 / best / 1e9
    out["read_gbs"] = max(out.values())
    return out


def build_layers(seed: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer's router, gate_up [E, 2I, H] and down [E, H, I], initializer-scaled."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        router = (torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.02).to(dtype)
        gate_up = torch.empty(EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN, dtype=dtype)
        down = torch.empty(EXPERTS, HIDDEN, MOE_INTERMEDIATE, dtype=dtype)
        for e in range(EXPERTS):  # an expert at a time: no float32 copy of a whole layer
            gate_up[e] = torch.randn(2 * MOE_INTERMEDIATE, HIDDEN, generator=gen) * 0.02
            down[e] = torch.randn(HIDDEN, MOE_INTERMEDIATE, generator=gen) * 0.02
        layers.append((router, gate_up, down))
    return layers


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _summary(seconds: list[float]) -> dict[str, float]:
    return {"median_ms": 1000 * statistics.median(seconds), "min_ms": 1000 * min(seconds)}


def _decode(blocks: list[SparseMoe], tokens: list[list[torch.Tensor]], expert_bytes: int, packed_bytes: int,
            router_bytes: int, bandwidth_gbs: float) -> dict[str, float]:
    """Each token through the layers, each layer's call timed on its own (a call reads a few
    tens of MB: short enough to fall between a shared machine's other work now and then)."""
    per_token, calls, active, read = [], [], [], []
    best: list[float] = [float("inf")] * len(blocks)
    for i, xs in enumerate(tokens):
        total = 0.0
        for layer, (block, x) in enumerate(zip(blocks, xs)):
            chosen = len(set(block.route(x)[1].flatten().tolist()))
            dt = _timed(lambda: block(x))
            if i < 2:  # warm-up
                continue
            total += dt
            nbytes = chosen * packed_bytes + router_bytes
            calls.append(nbytes / dt / 1e9)
            best[layer] = min(best[layer], dt)
            active.append(chosen * expert_bytes)
            read.append(nbytes)
        if i >= 2:
            per_token.append(total)
    entry = {"median_ms": 1000 * statistics.median(per_token), "best_ms": 1000 * sum(best),
             "active_expert_bytes_per_token": len(blocks) * statistics.mean(active),
             "bytes_read_per_token": len(blocks) * statistics.mean(read),
             "gbs_median": statistics.median(calls), "gbs_best": max(calls)}
    entry["read_over_active"] = entry["bytes_read_per_token"] / entry["active_expert_bytes_per_token"]
    entry["of_bandwidth_median"] = entry["gbs_median"] / bandwidth_gbs
    entry["of_bandwidth_best"] = entry["gbs_best"] / bandwidth_gbs
    return entry


def _measure(path: str, blocks: list[SparseMoe], tokens: list[list[torch.Tensor]], xs: list[torch.Tensor],
             rounds: int, threads: int, expert_bytes: int, read_bytes: int, router_bytes: int, args: Any,
             result: dict[str, Any]) -> None:
    """Decode at torch's thread count and one thread, then the prefill, of one path."""
    for n_threads in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n_threads)
        entry = _decode(blocks, tokens, expert_bytes, read_bytes, router_bytes, result["bandwidth"]["read_gbs"])
        result[f"decode_{path}_{n_threads}_threads"] = entry
        print(f"decode c=1 {path}, {n_threads} thread(s): {entry['median_ms']:.1f} ms/token median "
              f"({entry['best_ms']:.1f} from each layer's best call) over {LAYERS} layers; reads "
              f"{entry['bytes_read_per_token'] / 1e6:.1f} MB/token = {entry['read_over_active']:.3f}x the "
              f"active experts' {entry['active_expert_bytes_per_token'] / 1e6:.1f} MB; a layer's call "
              f"{entry['gbs_median']:.1f} GB/s median, {entry['gbs_best']:.1f} best = "
              f"{entry['of_bandwidth_median']:.0%} / {entry['of_bandwidth_best']:.0%} of the measured bandwidth")
    torch.set_num_threads(threads)
    if rounds > 1:  # a warm-up where there are rounds to spare (the old path's one round is long)
        for b, x in zip(blocks, xs):
            b(x)
    cpu0 = time.process_time()
    seconds = [_timed(lambda: [b(x) for b, x in zip(blocks, xs)]) for _ in range(rounds)]
    cpu = (time.process_time() - cpu0) / rounds
    s = _summary(seconds)
    # the experts' multiply-adds (3 GEMMs of hidden x intermediate a token and expert)
    flops = 2 * 3 * HIDDEN * MOE_INTERMEDIATE * TOP_K * args.prefill * LAYERS
    entry = {**s, "tokens_per_s_median": args.prefill * 1000 / s["median_ms"],
             "tokens_per_s_best": args.prefill * 1000 / s["min_ms"], "cpu_seconds": cpu,
             "expert_gflop_per_cpu_second": flops / cpu / 1e9}
    result[f"prefill_{path}"] = entry
    print(f"prefill {args.prefill} tokens {path}: {entry['tokens_per_s_median']:.0f} tok/s median "
          f"({entry['tokens_per_s_best']:.0f} best) over {LAYERS} layers; {cpu:.2f} CPU-s a round "
          f"(all threads, waits included), {entry['expert_gflop_per_cpu_second']:.0f} expert GFLOP a CPU-s")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--decode-tokens", type=int, default=24, help="tokens decoded one at a time (c=1)")
    p.add_argument("--prefill", type=int, default=512, help="tokens of the prefill")
    p.add_argument("--rounds", type=int, default=3, help="prefill rounds of the new path (the old one runs once)")
    p.add_argument("--skip-old", action="store_true", help="the new path only")
    p.add_argument("--out", default="bench_results/moe")
    args = p.parse_args()
    from prelude.bench.results import write_json

    dtype = torch.bfloat16
    result: dict[str, Any] = {"args": vars(args), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                              "load_average_before": os.getloadavg(),
                              "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K,
                                        "moe_intermediate": MOE_INTERMEDIATE, "layers": LAYERS, "dtype": "bfloat16"}}
    result["bandwidth"] = memory_bandwidth()
    print(f"memory read bandwidth: {result['bandwidth']['read_gbs']:.1f} GB/s "
          f"(1 thread {result['bandwidth']['read_gbs_1_thread']:.1f}, 2 threads "
          f"{result['bandwidth']['read_gbs_2_thread']:.1f})")

    weights = build_layers(0, dtype)
    expert_bytes = 3 * HIDDEN * MOE_INTERMEDIATE * dtype.itemsize
    router_bytes = EXPERTS * HIDDEN * dtype.itemsize
    gen = torch.Generator().manual_seed(1)
    # decode, c=1: each token through the 4 layers (each layer its own input, as the residual
    # stream's normed hidden would be: random here); prefill: `--prefill` tokens a layer
    tokens = [[torch.randn(1, HIDDEN, generator=gen).to(dtype) for _ in range(LAYERS)]
              for _ in range(args.decode_tokens + 2)]
    xs = [torch.randn(args.prefill, HIDDEN, generator=gen).to(dtype) for _ in range(LAYERS)]
    threads = torch.get_num_threads()
    references: list[torch.Tensor] = []
    with torch.inference_mode():
        # old first, on the checkpoint's tensors; then each layer packed and its tensors let go,
        # so the process holds the experts about once (4.8 GB), not twice
        if not args.skip_old:
            old = [SparseMoe(r, gu, dn, TOP_K, True, F.silu, own_kernels=False) for r, gu, dn in weights]
            _measure("old", old, tokens, xs, 1, threads, expert_bytes, expert_bytes, router_bytes, args, result)
            references = [o(x[:64]) for o, x in zip(old, xs)]
            del old
        new = []
        t0 = time.perf_counter()
        while weights:
            router, gate_up, down = weights.pop(0)
            new.append(SparseMoe(router, gate_up, down, TOP_K, True, F.silu))
            del gate_up, down
        result["pack_seconds"] = time.perf_counter() - t0
        if new[0].path != "cpu_kernel":
            raise SystemExit("moe_experts.c does not serve bf16 here (it needs AVX512-BF16): nothing new to measure")
        packed_bytes = new[0].packed.nbytes // EXPERTS  # type: ignore[union-attr]
        print(f"packed {LAYERS} layers in {result['pack_seconds']:.1f} s; an expert {expert_bytes / 1e6:.2f} MB, "
              f"its packed copy {packed_bytes / 1e6:.2f} MB")
        _measure("new", new, tokens, xs, args.rounds, threads, expert_bytes, packed_bytes, router_bytes, args, result)
        if references:
            result["prefill_speedup_median"] = (result["prefill_new"]["tokens_per_s_median"]
                                                / result["prefill_old"]["tokens_per_s_median"])
            result["decode_speedup_median"] = (result[f"decode_old_{threads}_threads"]["median_ms"]
                                               / result[f"decode_new_{threads}_threads"]["median_ms"])
            # the new path agrees with the old (on 64 of the prefill's tokens a layer)
            result["new_vs_old_max_relative_difference"] = max(
                (n(x[:64]).float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                for n, x, ref in zip(new, xs, references))
            print(f"new vs old: prefill {result['prefill_speedup_median']:.1f}x, decode "
                  f"{result['decode_speedup_median']:.1f}x (medians); outputs within "
                  f"{result['new_vs_old_max_relative_difference']:.2%} of the largest")
    result["load_average_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), result)
    print(f"load average {result['load_average_before']} -> {result['load_average_after']}; wrote "
          f"{out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
