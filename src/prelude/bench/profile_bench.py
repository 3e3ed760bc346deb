"""`prelude bench profile`: where a forward's time goes, per dtype, without writing a
profiler script.

In process (no HTTP), one engine per dtype on the default model (or --model), torch's
profiler around engine steps of two workloads, and a third on request:
- prefill: `--prefills` prompts of `--prompt-tokens` fresh tokens, one at a time, 1 output;
- decode: `--decode-rows` requests decoding together, `--decode-steps` steps;
- judge (`--judge P`): a warm judge wave, `--judge-requests` prompts of a cached P-token
  prefix and `--judge-suffix-tokens` new tokens each, handed over at once, 1 output each.
Each is split over the Python layer loop; where small steps take the C layer loop
(model/layer_loop.py: a step is one call there), that loop is timed against the Python
one after, on decode steps, unprofiled.
Each step's time is split into
- gemm: the projections (model/linear.py's Projection, whatever route it takes: oneDNN,
  GGUF blocks, F.linear) and any aten GEMM;
- attention: the attention backend's forward (its KV write and gathers included);
- elementwise: the fused C kernels and any eager pointwise/copy op outside the two above;
- other: the rest of the step's wall time (scheduling, sampling, Python, dispatch).
The labels come from wrappers this benchmark puts around those calls while it runs (no
cost on the serving path). Prints a table per dtype, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from prelude.bench.ceiling import drain, run_wave

CATEGORIES = ("gemm", "attention", "elementwise", "other")
_LABEL = "prelude::"
_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
                       "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm"})
_ATTENTION_OPS = frozenset({"aten::scaled_dot_product_attention"})
# Eager ops that move or combine activations element by element (the fused kernels' work).
_ELEMENTWISE_OPS = frozenset({
    "aten::add", "aten::add_", "aten::mul", "aten::mul_", "aten::sub", "aten::div", "aten::neg", "aten::pow",
    "aten::mean", "aten::rsqrt", "aten::silu", "aten::cat", "aten::to", "aten::_to_copy", "aten::copy_",
    "aten::contiguous", "aten::clone", "aten::chunk", "aten::split", "aten::reshape", "aten::view",
    "aten::index_copy_", "aten::index_select", "aten::embedding", "aten::empty", "aten::empty_like",
})


def _wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    import torch

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(_LABEL + label):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def labelled(model: Any) -> Iterator[None]:
    """Label the model's projections, attention and fused kernels for the profiler, and undo
    it after: a class attribute for Projection (the type's __call__ is what Python calls),
    instance attributes for the attention backend and the kernel set."""
    from prelude.kernels.cpu.cpu_fused import CpuFusedKernels
    from prelude.model.layers.linear import Projection

    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, label: str) -> None:
        saved.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else None))
        setattr(owner, name, _wrap(getattr(owner, name), label))

    patch(Projection, "__call__", "gemm")
    patch(model.attention, "forward", "attention")
    for name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "silu_mul"):
        patch(CpuFusedKernels, name, "elementwise")
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if isinstance(owner, type):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # back to the class's method


def _classify(event: Any, totals: dict[str, float], ops: dict[str, dict[str, float]]) -> None:
    """Attribute `event`'s inclusive time (us) to a category, or recurse into its children."""
    name = event.name
    if name.startswith(_LABEL):
        cat = name[len(_LABEL):]
    elif name in _GEMM_OPS:
        cat = "gemm"
    elif name in _ATTENTION_OPS:
        cat = "attention"
    elif name in _ELEMENTWISE_OPS:
        cat = "elementwise"
    elif event.cpu_children:
        for child in event.cpu_children:
            _classify(child, totals, ops)
        return
    else:
        cat = "other"
    totals[cat] += event.cpu_time_total
    if not name.startswith(_LABEL):
        ops[cat][name] = ops[cat].get(name, 0.0) + event.cpu_time_total
    else:  # a labelled call: its own ops, by self time, for the detail table
        for sub in _descendants(event):
            ops[cat][sub.name] = ops[cat].get(sub.name, 0.0) + sub.self_cpu_time_total
        ops[cat]["(python, ctypes)"] = ops[cat].get("(python, ctypes)", 0.0) + event.self_cpu_time_total


def _descendants(event: Any) -> Iterator[Any]:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def profile_steps(run: Callable[[], int], model: Any) -> dict[str, Any]:
    """Profile `run` (which returns how many forwards it ran): ms per forward by category."""
    from torch.profiler import ProfilerActivity, profile

    with labelled(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        forwards = run()
        wall_us = (time.perf_counter() - t0) * 1e6
    totals: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = defaultdict(dict)
    for event in prof.events():
        if event.cpu_parent is None:
            _classify(event, totals, ops)
    known = sum(totals[c] for c in ("gemm", "attention", "elementwise"))
    totals["other"] = max(0.0, wall_us - known)
    per = max(1, forwards)
    top = {c: sorted(((n, t / per / 1000) for n, t in ops[c].items()), key=lambda kv: -kv[1])[:6] for c in CATEGORIES}
    return {"forwards": forwards, "wall_ms_per_forward": wall_us / per / 1000,
            "ms_per_forward": {c: totals[c] / per / 1000 for c in CATEGORIES},
            "top_ops_ms": {c: [[n, round(t, 3)] for n, t in top[c]] for c in CATEGORIES}}


def _prompts(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(tokens)] for _ in range(n)]


def judge_wave(engine: Any, shared: list[int], suffixes: list[list[int]], params: Any, ids: Iterator[int]) -> int:
    """One judge wave: every prompt (`shared` + its suffix) handed over before the first step,
    then the engine run until all are answered; how many steps that took."""
    return run_wave(engine, [shared + suffix for suffix in suffixes], params, ids)


@dataclass(frozen=True)
class JudgeShape:
    """The judge profile's wave: `requests` prompts of a cached `prefix_tokens` prefix plus
    `suffix_tokens` new tokens each (prefix_tokens 0: no judge profile)."""

    prefix_tokens: int = 0
    requests: int = 16
    suffix_tokens: int = 64


def run_dtype(dtype: str, model_path: str | None, prefills: int, prompt_tokens: int, decode_rows: int,
              decode_steps: int, seed: int, prune_last_layer: bool = True, ab_last_layer: int = 0,
              ab_prefix_tokens: int = 0, judge: JudgeShape = JudgeShape()) -> dict[str, Any]:
    from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
    from prelude.engine.engine import LLMEngine
    from prelude.params import SamplingParams

    # No burst gathering: every workload here is handed over before its steps (as the offline
    # LLM's), and a held step would be spent spinning in the profile's "other".
    engine = LLMEngine.from_config(EngineConfig(
        model=model_path, executor=ExecutorConfig(device="cpu", dtype=dtype, prune_last_layer=prune_last_layer),
        cache=CacheConfig(kv_cache_memory_gib=1.0, enable_prefix_caching=ab_prefix_tokens > 0 or judge.prefix_tokens > 0),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, prompt_tokens + ab_prefix_tokens,
                                                             judge.requests * judge.suffix_tokens),
                                  oneshot_gather_ms=0.0),
    ))
    model = engine.runner.model
    vocab = int(model.config.vocab_size)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    long = SamplingParams(temperature=0.0, max_tokens=2 * decode_steps + 8, ignore_eos=True)
    counter = iter(range(10**9))

    def prefill_run(prompts: list[list[int]]) -> Callable[[], int]:
        def run() -> int:
            for ids in prompts:
                engine.add_request(f"p{next(counter)}", ids, one)
                drain(engine)
            return len(prompts)
        return run

    def decode_run(steps: int) -> Callable[[], int]:
        def run() -> int:
            for _ in range(steps):
                engine.step()
            return steps
        return run

    def start_decode(rows: int) -> None:
        for ids in _prompts(rows, 128, vocab, seed + next(counter)):
            engine.add_request(f"d{next(counter)}", ids, long)
        engine.step()  # the prompts' forward: the rows decode from the next step on

    prefill_run(_prompts(1, prompt_tokens, vocab, seed + 1))()  # warm-up: first-call allocations
    start_decode(decode_rows)
    decode_run(3)()
    engine.abort_all()
    drain(engine)
    # The split needs the Python layer loop's calls: a step that runs the C layer loop
    # (model/layer_loop.py: decode steps, and prompts up to its bound) is one call. That
    # loop is timed against the Python one after, on decode steps, unprofiled.
    c_loop, model.layer_loop = getattr(model, "layer_loop", None), None
    try:
        result = {"dtype": str(model.dtype).removeprefix("torch."),
                  "segments": engine.runner.forwards.__class__.__name__,
                  "prune_last_layer": engine.runner.prune_last_layer,
                  "prefill": profile_steps(prefill_run(_prompts(prefills, prompt_tokens, vocab, seed + 2)), model)}
        start_decode(decode_rows)
        result["decode"] = profile_steps(decode_run(decode_steps), model)
        if c_loop is not None and decode_steps > 0:  # fresh rows: the A/B's 2 x decode_steps steps
            engine.abort_all()
            drain(engine)
            start_decode(decode_rows)
            result["decode_c_loop"] = _ab_decode_loop(model, c_loop, engine.step, decode_steps)
        engine.abort_all()
        drain(engine)
        if judge.prefix_tokens > 0:
            shared = _prompts(1, judge.prefix_tokens, vocab, seed + 5)[0]

            def wave() -> int:
                suffixes = _prompts(judge.requests, judge.suffix_tokens, vocab, seed + 6 + next(counter))
                return judge_wave(engine, shared, suffixes, one, counter)

            wave()  # computes and caches the prefix (a cold wave), and the first calls' allocations
            result["judge"] = profile_steps(wave, model)
    finally:
        model.layer_loop = c_loop
    engine.abort_all()
    drain(engine)
    if ab_last_layer > 0:
        # the A/B's prompts share a cached prefix where asked (the judge's shape), else none
        shared = _prompts(1, ab_prefix_tokens, vocab, seed + 4)[0]
        prompts = [shared + ids for ids in _prompts(2 * ab_last_layer + 1, prompt_tokens, vocab, seed + 3)]
        prefill_run(prompts[:1])()  # publishes the shared prefix
        result["last_layer_ab"] = _ab_last_layer(engine, prefill_run, prompts[1:])
    return result


def _ab_decode_loop(model: Any, c_loop: Any, step: Callable[[], object], steps: int) -> dict[str, float]:
    """Decode steps alternating the C layer loop (`c_loop`) and the Python one, no profiler:
    median wall ms a step of each."""
    import statistics

    times: dict[str, list[float]] = {"c": [], "python": []}
    for i in range(2 * steps):
        mode = ("c", "python")[i % 2]
        model.layer_loop = c_loop if mode == "c" else None
        t0 = time.perf_counter()
        step()
        times[mode].append((time.perf_counter() - t0) * 1000)
    return {f"{m}_median_ms": statistics.median(t) for m, t in times.items()}


def _ab_last_layer(engine: Any, prefill_run: Callable[[list[list[int]]], Callable[[], int]],
                   prompts: list[list[int]]) -> dict[str, Any]:
    """One prefill at a time, the last layer computing every position (off) and only the
    read one (on), alternated in this one engine, no profiler: wall ms per prefill, and the
    process's CPU ms (steadier than wall time on a shared machine, at one thread)."""
    import statistics

    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    runner = engine.runner
    saved = runner.prune_last_layer
    try:
        for i, ids in enumerate(prompts):
            mode = ("off", "on")[i % 2]
            runner.prune_last_layer = mode == "on"
            t0, c0 = time.perf_counter(), time.process_time()
            prefill_run([ids])()
            times[mode].append((time.perf_counter() - t0) * 1000)
            cpu[mode].append((time.process_time() - c0) * 1000)
    finally:
        runner.prune_last_layer = saved
    return {m: {"median_ms": statistics.median(t), "ms": [round(x, 2) for x in t],
                "median_cpu_ms": statistics.median(cpu[m]), "cpu_ms": [round(x, 2) for x in cpu[m]]}
            for m, t in times.items()}


def print_result(res: dict[str, Any], prompt_tokens: int, decode_rows: int, judge: JudgeShape = JudgeShape()) -> None:
    works = [("prefill", f"{prompt_tokens}-token prefill"), ("decode", f"{decode_rows}-row decode step")]
    if "judge" in res:
        works.append(("judge", f"judge step ({judge.requests} x {judge.suffix_tokens} over a cached {judge.prefix_tokens})"))
    for work, what in works:
        r = res[work]
        parts = "  ".join(f"{c} {r['ms_per_forward'][c]:7.2f} ms ({100 * r['ms_per_forward'][c] / r['wall_ms_per_forward']:3.0f}%)"
                          for c in CATEGORIES)
        print(f"{res['dtype']:>9} {what:<22} {r['wall_ms_per_forward']:8.2f} ms/forward: {parts}")
        for c in CATEGORIES[:3]:
            top = ", ".join(f"{n} {t:.2f}" for n, t in r["top_ops_ms"][c][:4])
            print(f"{'':>12}{c:<12} {top}")
        if work == "decode" and "decode_c_loop" in res:
            ab = res["decode_c_loop"]
            print(f"{'':>12}(split over the Python layer loop; with the C layer loop, layer_loop.c, a step "
                  f"took {ab['c_median_ms']:.2f} ms against {ab['python_median_ms']:.2f}, alternated, unprofiled)")


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = ("prefill", "decode") + (("judge",) if all("judge" in r for r in results) else ())
    fig, axes = plt.subplots(1, len(works), figsize=(5.5 * len(works), 4))
    for ax, work in zip(axes, works):
        bottom = [0.0] * len(results)
        labels = [r["dtype"] for r in results]
        for c in CATEGORIES:
            vals = [r[work]["ms_per_forward"][c] for r in results]
            ax.bar(labels, vals, bottom=bottom, label=c)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{work}: ms per forward")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prelude bench profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--prefills", type=int, default=4)
    p.add_argument("--decode-rows", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prune-last-layer", dest="prune_last_layer", action="store_false",
                   help="the last layer computes every position (the before of that change)")
    p.add_argument("--ab-last-layer", type=int, default=0, metavar="N",
                   help="after the profiles, N prefills each with the last layer computing every position and "
                        "only the read one, alternated in the same engine (no profiler): medians")
    p.add_argument("--ab-prefix-tokens", type=int, default=0, metavar="P",
                   help="the A/B's prompts: a shared P-token prefix (cached: prefix caching on) before the "
                        "--prompt-tokens new ones")
    p.add_argument("--judge", type=int, default=0, metavar="P",
                   help="also profile a warm judge wave: --judge-requests prompts of a cached P-token prefix and "
                        "--judge-suffix-tokens new tokens each, handed over at once (0: no judge profile)")
    p.add_argument("--judge-requests", type=int, default=16)
    p.add_argument("--judge-suffix-tokens", type=int, default=64)
    p.add_argument("--out", default="bench_results/profile")
    args = p.parse_args(argv)
    judge = JudgeShape(args.judge, args.judge_requests, args.judge_suffix_tokens)
    from prelude.bench.results import write_json
    from prelude.executor.device import cpu_isa_flags

    flags = sorted(f for f in cpu_isa_flags() if f.startswith(("avx", "amx")))
    print(f"CPU flags: {' '.join(flags) or 'none'}; last layer for the read positions only: "
          f"{'on' if args.prune_last_layer else 'off'}")
    results = []
    for dtype in args.dtypes.split(","):
        res = run_dtype(dtype, args.model, args.prefills, args.prompt_tokens, args.decode_rows, args.decode_steps,
                        args.seed, args.prune_last_layer, args.ab_last_layer, args.ab_prefix_tokens, judge)
        print_result(res, args.prompt_tokens, args.decode_rows, judge)
        if "last_layer_ab" in res:
            ab = res["last_layer_ab"]
            cached = f"{args.ab_prefix_tokens} cached + " if args.ab_prefix_tokens else ""
            print(f"{res['dtype']:>9} {cached}{args.prompt_tokens}-token prefill, last layer for every position "
                  f"{ab['off']['median_ms']:.2f} ms ({ab['off']['median_cpu_ms']:.2f} ms CPU), for the read one "
                  f"{ab['on']['median_ms']:.2f} ms ({ab['on']['median_cpu_ms']:.2f} ms CPU) "
                  f"(medians of {len(ab['on']['ms'])} alternated)")
        results.append(res)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), {"cpu_flags": flags, "args": vars(args), "results": results})
    print(f"wrote {plot(results, out.with_suffix('.png'))}")
    return 0
