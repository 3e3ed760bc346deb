"""One layer's attention call, C paged kernel ("cpu") vs torch SDPA ("torch"), on the CPU.

Shapes (SmolLM2-135M's heads by default: 9 query / 3 KV heads of 64):
- judge: `rows` rows of `prefix` cached + `new` tokens (OneShot: the new tokens' K/V are the
  forward's own, as the judge's classify rows run);
- decode at each concurrency of `--decode`: one query per row over `decode_ctx` cached tokens.
Each case times both backends on the same tensors, alternated call by call (order flipped
every round), and reports medians, plus the load average (this machine's is shared);
`--clock cpu --threads 1` times the calling thread's CPU time instead of the wall clock.
`--baseline DIR` times another version of the kernel in the same rounds: DIR is a checkout
of an older revision (`git worktree add /tmp/old REV`, or `git archive REV src | tar -x -C
/tmp/old`), whose cpu_backend.py and cpu_attention.c are loaded together (their C
signature may differ from today's).
Writes JSON and, with matplotlib, a PNG beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from prelude.bench.results import write_json
from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillTensors, PrefillSlice

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _case(rows: int, prefix: int, new: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
          dtype: torch.dtype, shared: bool = False) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata]:
    """Inputs of one layer call: rows of `prefix` pooled tokens and `new` tokens (new == 1:
    decode rows with their token written to the pool; else OneShot rows). `shared`: every
    row's whole prefix blocks are the same blocks (a judge's cached rubric, which the rows'
    items then read from the caches), else each row has its own."""
    decode = new == 1
    ctx = prefix + new
    per_row = (ctx + block_size - 1) // block_size
    common = prefix // block_size if shared else 0
    num_blocks = common + rows * (per_row - common) + 1
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered blocks, as a busy pool has
    own = order[common:common + rows * (per_row - common)].view(rows, per_row - common)
    tables = torch.cat([order[:common].expand(rows, common), own], dim=1).contiguous()
    total = rows * new
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    starts = torch.arange(rows) * new
    if decode:
        slots = torch.stack([tables[r, prefix // block_size] * block_size + prefix % block_size for r in range(rows)])
        meta = AttentionMetadata(slots, (), DecodeRows(starts, tables, torch.full((rows,), ctx), ctx), block_size)
    else:
        prefills = tuple(PrefillSlice(int(s), new, ctx, tables[r], own_kv_in_cache=False) for r, s in enumerate(starts))
        tensors = PrefillTensors(starts, torch.full((rows,), new), torch.full((rows,), ctx),
                                 torch.zeros(rows, dtype=torch.int64), tables, new)
        meta = AttentionMetadata(None, prefills, None, block_size, prefill_tensors=tensors)
    return (q, k, v, k_cache, v_cache), meta


def _time(backends: dict[str, Any], inputs: tuple[torch.Tensor, ...], meta: AttentionMetadata, scale: float,
          rounds: int, clock: Any = time.perf_counter) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in backends}
    names = list(backends)
    with torch.inference_mode():
        for name in names:  # warm-up (builds, first-touch)
            backends[name].forward(*inputs, meta, scale)
        for i in range(rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                t0 = clock()
                backends[name].forward(*inputs, meta, scale)
                samples[name].append(clock() - t0)
    return {name: 1000 * statistics.median(s) for name, s in samples.items()}


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['case']}\n{r['dtype']}" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["torch_ms"] for r in results], width=0.4, label="torch SDPA")
    ax.bar([i + 0.2 for i in x], [r["cpu_ms"] for r in results], width=0.4, label="C paged kernel")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ms per layer call (median)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _baseline_kernel(checkout: Path) -> Any:
    """The CPU attention backend of an older checkout: its cpu_backend.py (which finds its
    own cpu_attention.c beside it) loaded as a module of its own."""
    import hashlib
    import importlib.util
    import sys

    path = checkout.resolve() / "src/prelude/model/attention/cpu_backend.py"
    name = "prelude_baseline_cpu_backend_" + hashlib.sha256(str(path).encode()).hexdigest()[:8]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no cpu_backend.py at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    kernel = module.load_cpu_attention()
    if kernel is None:
        raise SystemExit(f"the baseline kernel at {checkout} does not build here")
    return kernel


def judge_shape(spec: str) -> tuple[int, int, int] | None:
    """(rows, prefix, new) of a ROWSxPREFIX+NEW spec; None when it is not one (rows and new
    at least 1, prefix at least 0)."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)\+(\d+)\s*", spec)
    if m is None:
        return None
    rows, prefix, new = (int(g) for g in m.groups())
    return (rows, prefix, new) if rows > 0 and new > 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attention")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--judge", default="16x1024+64",
                    help="ROWSxPREFIX+NEW, several comma-separated ('' to skip)")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="the judge rows read one set of prefix blocks (a cached rubric), not one each")
    ap.add_argument("--decode", default="4,16,64", help="decode concurrencies ('' to skip)")
    ap.add_argument("--decode-ctx", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: torch's default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1: what other tenants of a shared "
                         "machine barely move)")
    ap.add_argument("--baseline", default="", help="a checkout of an older revision: its kernel timed beside")
    ap.add_argument("--json", default="bench_results/attention.json")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        ap.error("--clock cpu times the calling thread only: use it with --threads 1")
    cases: list[tuple[str, int, int, int]] = []
    for spec in filter(None, args.judge.split(",")):
        shape = judge_shape(spec)
        if shape is None:
            ap.error(f"--judge {spec!r}: expected ROWSxPREFIX+NEW, e.g. 16x1024+64")
        cases.append((f"judge {spec}{' shared' if args.shared_prefix else ''}", *shape))
    for c in filter(None, args.decode.split(",")):
        if not c.strip().isdigit() or int(c) < 1 or args.decode_ctx < 1:
            ap.error(f"--decode {c!r} with --decode-ctx {args.decode_ctx}: rows and context must be positive integers")
        cases.append((f"decode c={c.strip()} ctx={args.decode_ctx}", int(c), args.decode_ctx - 1, 1))
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    from prelude.model.attention.cpu_backend import load_cpu_attention
    from prelude.model.attention.torch_backend import TorchAttention

    kernel = load_cpu_attention()
    if kernel is None:
        print("the C attention kernel is off here (see the log line above); nothing to compare")
        return 1
    backends: dict[str, Any] = {"torch": TorchAttention(), "cpu": kernel}
    if args.baseline:
        backends["baseline"] = _baseline_kernel(Path(args.baseline))
    results = []
    print(f"clock {args.clock}, threads {torch.get_num_threads()}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"heads {args.heads}/{args.kv_heads}x{args.head_dim}, block {args.block_size}")
    base = " baseline ms |" if args.baseline else ""
    print(f"| case | dtype | torch SDPA ms |{base} C kernel ms | speed-up | loadavg |")
    print("|---|---|---|---|---|---|" + ("---|" if args.baseline else ""))
    for dtype_name in args.dtypes.split(","):
        dtype = _DTYPES[dtype_name]
        for label, rows, prefix, new in cases:
            shared = args.shared_prefix and label.startswith("judge")
            inputs, meta = _case(rows, prefix, new, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype,
                                 shared)
            ms = _time(backends, inputs, meta, args.head_dim**-0.5, args.rounds, clock)
            load = os.getloadavg()[0]
            results.append({"case": label, "dtype": dtype_name, "torch_ms": ms["torch"], "cpu_ms": ms["cpu"],
                            "baseline_ms": ms.get("baseline"), "loadavg_1m": load})
            old = f" {ms['baseline']:.2f} |" if args.baseline else ""
            print(f"| {label} | {dtype_name} | {ms['torch']:.2f} |{old} {ms['cpu']:.2f} | {ms['torch'] / ms['cpu']:.2f}x "
                  f"| {load:.2f} |", flush=True)
    path = write_json(args.json, {"config": vars(args), "threads": torch.get_num_threads(), "results": results})
    if plot(results, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
