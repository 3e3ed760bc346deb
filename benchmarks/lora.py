"""`python -m benchmarks.lora`: what serving LoRA adapters costs a step.

In process (no HTTP, no scheduler: the cost under test is the forward), the default model
(or --model) in one runner with `--adapters` random PEFT adapters of rank `--rank` on all
seven projections, resident in slots. Steps, alternated trial by trial, medians:
- decode: `--rows` rows decoding one token each at context `--context`, each row under a
  different adapter ("lora") vs every row on the base ("base"), same batch;
- prefill: `--rows` prompts of `--prompt-tokens` tokens, one adapter each vs the base;
- no adapter loaded: the same base decode and prefill steps on a runner built without
  LoRA slots ("plain") vs one with its slots loaded ("base" rows take the plain forward
  there too): with no adapter in a step nothing of LoRA runs.
A step is runner.launch(...).wait() (forward, logits of the last tokens, greedy sampling). The
machine's load average is recorded before and after. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

GOALS = {"decode": 1.25, "prefill": 1.15}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: Path, config: Any, rank: int, seed: int) -> None:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random
    A and B on all seven projections of every layer."""
    import torch
    from safetensors.torch import save_file

    from prelude.model.lora.adapters import _shapes

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target, (fan_in, fan_out) in _shapes(config).items():
            part = "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "use_rslora": False}))


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def _runner(model: str | None, dtype: str, lora: Any, block_size: int) -> Any:
    from prelude.config import ExecutorConfig
    from prelude.executor.runner import ModelRunner
    from prelude.model.loading.files import load_model_files

    loaded = load_model_files(model)
    runner = ModelRunner.create(loaded.config, loaded.weights, ExecutorConfig(dtype=dtype), block_size,
                                blocks=loaded.blocks, lora=lora)
    return runner, loaded.config


def _batches(rows: int, context: int, prompt_tokens: int, block_size: int, loras: list[Any]) -> dict[str, Any]:
    """decode/prefill batches, each with and without adapters (the same rows otherwise)."""
    import random

    from prelude.forward_batch import BatchRow, DecodeBatch, MixedBatch, SampleSpec
    from prelude.params import SamplingParams

    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    per_row = -(-max(context, prompt_tokens) // block_size)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
    prompts = [[rng.randrange(1000, 20000) for _ in range(prompt_tokens)] for _ in range(rows)]
    out: dict[str, Any] = {}
    for kind, row_loras in (("base", [None] * rows), ("lora", [loras[i % len(loras)] for i in range(rows)])):
        out[f"decode-{kind}"] = DecodeBatch(tuple(
            BatchRow(f"d{i}", [rng.randrange(1000, 20000)], context - 1, tables[i],
                     SampleSpec(greedy, prompts[i], []), lora=row_loras[i]) for i in range(rows)))
        out[f"prefill-{kind}"] = MixedBatch(tuple(
            BatchRow(f"p{i}", prompts[i], 0, tables[i], SampleSpec(greedy, prompts[i], []), lora=row_loras[i])
            for i in range(rows)), ())
    return out, rows * per_row


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _alternate(steps: dict[str, Callable[[], None]], trials: int, clock: str = "wall") -> dict[str, list[float]]:
    """Each step `trials` times, in alternating order (flipped every round); seconds of
    `clock` (CLOCKS)."""
    now = CLOCKS[clock]
    names = list(steps)
    for name in names:  # warm-up: shapes compiled, packed weights made, slots loaded
        steps[name]()
        steps[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for t in range(trials):
        for name in names if t % 2 == 0 else names[::-1]:
            t0 = now()
            steps[name]()
            times[name].append(now() - t0)
    return times


def run(model: str | None, dtype: str, adapters: int, rank: int, rows: int, context: int, prompt_tokens: int,
        trials: int, prefill_trials: int, clock: str = "wall") -> dict[str, Any]:
    from prelude.config import LoraConfig
    from prelude.params import LoraRequest

    block_size = 16
    runner, config = _runner(model, dtype, LoraConfig(max_loras=adapters, max_lora_rank=rank), block_size)
    plain, _ = _runner(model, dtype, None, block_size)
    loras = []
    with tempfile.TemporaryDirectory(prefix="prelude-lora-bench-") as root:
        for i in range(adapters):
            write_random_adapter(Path(root) / f"a{i}", config, rank, seed=i)
            loras.append(LoraRequest(f"a{i}", str(Path(root) / f"a{i}"), i + 1))
        batches, blocks = _batches(rows, context, prompt_tokens, block_size, loras)
        for r in (runner, plain):
            r.allocate_kv_cache(blocks)
        runner.launch(batches["decode-lora"]).wait()  # loads every adapter into its slot (from disk, once)
    load_before = _loadavg()
    decode = _alternate({
        "base": lambda: runner.launch(batches["decode-base"]).wait(),
        "lora": lambda: runner.launch(batches["decode-lora"]).wait(),
        "plain": lambda: plain.launch(batches["decode-base"]).wait(),
    }, trials, clock)
    prefill = _alternate({
        "base": lambda: runner.launch(batches["prefill-base"]).wait(),
        "lora": lambda: runner.launch(batches["prefill-lora"]).wait(),
        "plain": lambda: plain.launch(batches["prefill-base"]).wait(),
    }, prefill_trials, clock)
    load_after = _loadavg()
    med = {work: {k: 1000 * statistics.median(v) for k, v in times.items()}
           for work, times in (("decode", decode), ("prefill", prefill))}
    ratios = {work: {"lora_vs_base": m["lora"] / m["base"], "base_with_slots_vs_plain": m["base"] / m["plain"]}
              for work, m in med.items()}
    return {
        "dtype": str(runner.model.dtype).removeprefix("torch."), "device": str(runner.device),
        "workload": {"adapters": adapters, "rank": rank, "targets": list(TARGETS), "rows": rows, "context": context,
                     "prompt_tokens": prompt_tokens, "trials": trials, "prefill_trials": prefill_trials,
                     "clock": clock},
        "lora_slot_mib": runner.adapters.nbytes / 2**20,
        "median_ms": med, "ratios": ratios,
        "goals": {work: {"goal": GOALS[work], "met": ratios[work]["lora_vs_base"] <= GOALS[work]} for work in GOALS},
        "trials_ms": {"decode": {k: [1000 * x for x in v] for k, v in decode.items()},
                      "prefill": {k: [1000 * x for x in v] for k, v in prefill.items()}},
        "loadavg_before": load_before, "loadavg_after": load_after,
    }


def print_result(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(f"{r['dtype']} on {r['device']}: {w['adapters']} adapters of rank {w['rank']} on all 7 projections "
          f"({r['lora_slot_mib']:.1f} MiB of slots), {w['rows']} rows, medians of {w['trials']}/{w['prefill_trials']}"
          f" alternated trials ({w.get('clock', 'wall')} clock); load average {r['loadavg_before']} -> {r['loadavg_after']}")
    for work in ("decode", "prefill"):
        m, q = r["median_ms"][work], r["ratios"][work]
        what = (f"{w['rows']} rows at context {w['context']}" if work == "decode"
                else f"{w['rows']} x {w['prompt_tokens']}-token prompts")
        verdict = "met" if r["goals"][work]["met"] else "short"
        print(f"  {work:<8}({what}): base {m['base']:.1f} ms, {w['rows']} adapters mixed {m['lora']:.1f} ms "
              f"= {q['lora_vs_base']:.3f}x (goal <= {GOALS[work]}x: {verdict}); no LoRA slots {m['plain']:.1f} ms "
              f"(base rows with slots loaded / without: {q['base_with_slots_vs_plain']:.3f}x)")


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, work in zip(axes, ("decode", "prefill")):
        labels, vals = [], []
        for r in results:
            for k in ("plain", "base", "lora"):
                labels.append(f"{r['dtype']}\n{k}")
                vals.append(r["median_ms"][work][k])
        ax.bar(labels, vals, color=["#999", "#4a7", "#c54"] * len(results))
        ax.set_title(f"{work}: ms per step (median)")
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--dtypes", default="auto", help="comma-separated: auto, float32, bfloat16")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--context", type=int, default=256, help="decode rows' context length")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--trials", type=int, default=40, help="decode steps per variant")
    p.add_argument("--prefill-trials", type=int, default=10)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 keeps a loaded shared machine's noise down")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: elapsed time; cpu: the process's CPU time, steadier on a loaded shared machine "
                        "with --threads 1 (it leaves out the time a step waited for a core; with more threads it "
                        "also counts their spin-waits)")
    p.add_argument("--out", default="bench_results/lora")
    args = p.parse_args(argv)
    import torch

    from prelude.bench.results import write_json

    if args.threads:
        torch.set_num_threads(args.threads)

    results = []
    for dtype in args.dtypes.split(","):
        res = run(args.model, dtype, args.adapters, args.rank, args.rows, args.context, args.prompt_tokens,
                  args.trials, args.prefill_trials, args.clock)
        print_result(res)
        results.append(res)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), {"args": vars(args), "cpu_count": os.cpu_count(),
                                          "torch_threads": torch.get_num_threads(), "results": results})
    print(f"wrote {plot(results, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
