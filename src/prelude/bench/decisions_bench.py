"""`prelude bench decisions`: multi-item scoring and whole-label classification, measured
against the ways a client would do the same work without them. Prefix cache on throughout.

1. Generative scoring, a fresh 300-token query with 10 items of 64 tokens per request,
   items/s at concurrency 1 and 16:
   - `multi-item`: one /v1/score request, the items packed into one row;
   - `rows`: one /v1/score request with `multi_item: false` (one row per item; the
     query's blocks are shared through the prefix cache);
   - `separate`: ten /v1/score calls with one item each (the client-side fan-out).
2. Whole-label classification of a fresh 128-token prompt with 4 labels of 1 to 4 tokens,
   at concurrency 1: one /classify request (the labels packed as items), K /classify calls
   with one label each, and the cost of one plain forward of the prompt (two one-token
   labels) as the unit.
3. Fused vs alternating steps (fused_bench.py, in process): chat streams next to classify
   traffic, decode TPOT P99 and OneShot E2E P50/P99 with OneShot rows riding in the
   Decode/Mixed forward vs steps alternating between the classes (`--mixed-only`).
4. Admission-time tokenization with and without the prefix memo (`--tokenize-only`).
5. Typed decisions (`--typed-only`, typed_decisions_bench.py): 16 questions about one input
   as one /v1/decisions request vs 16 one-token chat completions vs one /classify.
Modes alternate request by request (concurrency 1) or round by round (concurrency 16);
medians are reported. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any, Awaitable, Callable

import httpx

from prelude.bench.prompts import exact_prompt
from prelude.bench.results import write_json
from prelude.bench.server_proc import prelude_server

Body = dict[str, Any]


class Workload:
    """Fresh token-id queries, items and classify prompts (exact lengths, served tokenizer)."""

    def __init__(self, seed: int, query_tokens: int, item_tokens: int, num_items: int, prompt_tokens: int) -> None:
        from prelude.model.loading.files import load_model_files

        self.tok = load_model_files(None).tokenizer
        self.rng = random.Random(seed)
        self.query_tokens, self.item_tokens, self.num_items = query_tokens, item_tokens, num_items
        self.prompt_tokens = prompt_tokens

    def ids(self, n: int) -> list[int]:
        return self.tok.encode(exact_prompt(n, self.rng, self.tok), add_special_tokens=False)

    def scoring(self) -> tuple[list[int], list[list[int]]]:
        return self.ids(self.query_tokens), [self.ids(self.item_tokens) for _ in range(self.num_items)]

    def labels(self) -> list[str]:
        """Four labels of 1, 2, 3 and 4 tokens (as /classify tokenizes them)."""
        out = []
        for n in (1, 2, 3, 4):
            while True:
                text = " " + exact_prompt(n, self.rng, self.tok)
                if len(self.tok.encode(text, add_special_tokens=False)) == n:
                    out.append(text)
                    break
        return out


LABEL_IDS = [0, 1]  # any two ids: the cost does not depend on which


async def _score(client: httpx.AsyncClient, base: str, query: list[int], items: list[list[int]], mode: str) -> None:
    if mode == "separate":
        for item in items:
            r = await client.post(base + "/v1/score", json={"query": query, "items": [item],
                                                            "label_token_ids": LABEL_IDS})
            r.raise_for_status()
        return
    body = {"query": query, "items": items, "label_token_ids": LABEL_IDS, "multi_item": mode == "multi-item"}
    r = await client.post(base + "/v1/score", json=body)
    r.raise_for_status()


async def _timed(call: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await call()
    return time.perf_counter() - t0


async def scoring_c1(base: str, work: Workload, modes: list[str], iters: int) -> dict[str, list[float]]:
    """Seconds per query (10 items) at concurrency 1, modes alternating query by query."""
    out: dict[str, list[float]] = {m: [] for m in modes}
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(iters + 1):  # the first round warms up
            order = modes if i % 2 == 0 else modes[::-1]
            for mode in order:
                query, items = work.scoring()
                dt = await _timed(lambda: _score(client, base, query, items, mode))
                if i > 0:
                    out[mode].append(dt)
    return out


async def scoring_concurrent(
    base: str, work: Workload, modes: list[str], concurrency: int, queries: int, rounds: int
) -> dict[str, list[float]]:
    """Items/s of closed-loop clients, one round per mode in turn; one figure per round."""
    out: dict[str, list[float]] = {m: [] for m in modes}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency * 10)) as client:
        for rnd in range(rounds):
            for mode in modes if rnd % 2 == 0 else modes[::-1]:
                batch = [work.scoring() for _ in range(queries)]
                queue = list(range(queries))

                async def worker() -> None:
                    while queue:
                        q, items = batch[queue.pop()]
                        await _score(client, base, q, items, mode)

                t0 = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(concurrency)))
                out[mode].append(queries * work.num_items / (time.perf_counter() - t0))
    return out


async def classify_c1(base: str, work: Workload, iters: int) -> tuple[dict[str, list[float]], list[str]]:
    """Seconds per prompt: plain forward (two one-token labels), whole-label (4 labels in
    one request), K calls of one label each; alternating prompt by prompt."""
    labels = work.labels()
    modes = ["one forward", "whole-label packed", "K separate calls"]
    out: dict[str, list[float]] = {m: [] for m in modes}
    async with httpx.AsyncClient(timeout=600) as client:

        async def classify(prompt: list[int], names: list[str]) -> None:
            r = await client.post(base + "/classify", json={"input": [prompt], "labels": names})
            r.raise_for_status()

        async def k_calls(prompt: list[int]) -> None:
            for name in labels:
                await classify(prompt, [name])

        for i in range(iters + 1):
            order = modes if i % 2 == 0 else modes[::-1]
            for mode in order:
                prompt = work.ids(work.prompt_tokens)
                if mode == "one forward":
                    dt = await _timed(lambda: classify(prompt, [" yes", " no"]))
                elif mode == "whole-label packed":
                    dt = await _timed(lambda: classify(prompt, labels))
                else:
                    dt = await _timed(lambda: k_calls(prompt))
                if i > 0:
                    out[mode].append(dt)
    return out, labels


def mask_cost(dtype: str, batch: int, steps: int) -> dict[str, float]:
    """Structured outputs at decode batch `batch`, in process: the time to compute the
    grammar masks of a step (llguidance, one JSON-schema matcher per row) and to apply them
    in the sampler, against the decode step itself. Constrained and free steps alternate."""
    import json

    import numpy as np
    import torch

    from prelude.config import EngineConfig, ExecutorConfig
    from prelude.engine.engine import LLMEngine
    from prelude.executor.sampler import _apply_token_masks
    from prelude.forward_batch import SampleSpec
    from prelude.params import SamplingParams, StructuredOutput

    engine = LLMEngine.from_config(EngineConfig(executor=ExecutorConfig(dtype=dtype)))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "tags"]}
    spec = StructuredOutput("json", json.dumps(schema))
    prompt = engine.tokenizer.encode("Describe a person as JSON: ", add_special_tokens=False)
    free = SamplingParams(max_tokens=steps + 4, temperature=1.0, ignore_eos=True)
    for i in range(batch):  # free rows: the decode steps to compare with
        engine.add_request(f"f{i}", prompt, free)
    for _ in range(3):
        engine.step()
    matchers = [engine.grammars.matcher(spec) for _ in range(batch)]
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    step_s, mask_s, apply_s = [], [], []
    logits = torch.randn(batch, vocab)
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        masks = [m.bitmask() for m in matchers]
        mask_s.append(time.perf_counter() - t0)
        specs = [SampleSpec(free, prompt, [], 0, mk) for mk in masks]
        t0 = time.perf_counter()
        allowed = _apply_token_masks(logits, specs)
        apply_s.append(time.perf_counter() - t0)
        for m, row in zip(matchers, allowed):  # advance each matcher by an allowed token
            ok = torch.isfinite(row).nonzero().flatten()
            m.accept(int(ok[int(rng.integers(len(ok)))]) if len(ok) else 0)
    engine.abort_all()
    med = statistics.median
    return {"batch": batch, "decode_step_ms_p50": 1000 * med(step_s), "mask_compute_ms_p50": 1000 * med(mask_s),
            "mask_apply_ms_p50": 1000 * med(apply_s),
            "mask_over_step": (med(mask_s) + med(apply_s)) / med(step_s)}


def prefix_encode_gain(iters: int, seed: int) -> dict[str, Any]:
    """Admission-time tokenization with and without the prefix memo, in process: a chat with
    a ~2,000-token system prompt and a short user turn (template rendered, then encoded), and
    a 300-token /v1/score query. The two ways alternate call by call; medians."""
    from prelude.model.loading.files import load_model_files
    from prelude.tokenizer.prefix_encode import encode_chat_prompt, encode_joined

    tok = load_model_files(None).tokenizer
    rng = random.Random(seed)
    system = exact_prompt(2000, rng, tok)
    query = exact_prompt(300, rng, tok)
    users = [exact_prompt(40, rng, tok) for _ in range(iters)]
    timings: dict[str, list[float]] = {k: [] for k in ("chat_full", "chat_memo", "query_full", "query_memo")}
    for i, user in enumerate(users):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        ways = [("full", lambda m=messages: tok.encode(tok.apply_chat_template(m), add_special_tokens=False)),
                ("memo", lambda m=messages: encode_chat_prompt(tok, tok.apply_chat_template(m), m))]
        for name, call in ways if i % 2 == 0 else ways[::-1]:
            t0 = time.perf_counter()
            ids = call()
            timings[f"chat_{name}"].append(time.perf_counter() - t0)
        assert ids == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        qways = [("full", lambda: tok.encode(query)), ("memo", lambda: encode_joined(tok, query, "", True))]
        for name, call in qways if i % 2 == 0 else qways[::-1]:
            t0 = time.perf_counter()
            call()
            timings[f"query_{name}"].append(time.perf_counter() - t0)
    med = {k: 1e6 * _median(v[1:]) for k, v in timings.items()}  # microseconds; the first call warms the memo
    return {"system_tokens": 2000, "user_tokens": 40, "query_tokens": 300, "iters": iters, "median_us": med,
            "chat_speedup": med["chat_full"] / med["chat_memo"], "query_speedup": med["query_full"] / med["query_memo"]}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude bench decisions")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--query-tokens", type=int, default=300)
    ap.add_argument("--item-tokens", type=int, default=64)
    ap.add_argument("--items", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="classify prompt length")
    ap.add_argument("--iters", type=int, default=8, help="queries per mode at concurrency 1")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--queries", type=int, default=32, help="queries per mode and round at high concurrency")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="extra `prelude serve` flags")
    ap.add_argument("--json", default="bench_results/decisions.json")
    ap.add_argument("--mask-only", action="store_true", help="only the structured-output mask cost")
    ap.add_argument("--mixed-only", action="store_true", help="only fused vs alternating steps (chat + classify)")
    ap.add_argument("--mixed-rounds", type=int, default=3)
    ap.add_argument("--mixed-seconds", type=float, default=20.0, help="arrivals per trial")
    ap.add_argument("--mixed-streams", type=int, default=4, help="closed-loop chat streams")
    ap.add_argument("--mixed-chat-tokens", type=int, default=96)
    ap.add_argument("--mixed-output-tokens", type=int, default=32)
    ap.add_argument("--mixed-classify-tokens", type=int, default=128)
    ap.add_argument("--mixed-rate", type=float, default=1.0, help="classify requests per second (Poisson)")
    ap.add_argument("--tokenize-only", action="store_true", help="only the admission-time prefix-memo gain")
    ap.add_argument("--typed-only", action="store_true", help="only typed decisions (/v1/decisions)")
    ap.add_argument("--typed-input-tokens", type=int, default=1024)
    ap.add_argument("--typed-concurrency", type=int, default=8)
    ap.add_argument("--typed-inputs", type=int, default=24, help="inputs per mode in the concurrent stream")
    args = ap.parse_args(argv)
    if args.typed_only:
        from prelude.bench.typed_decisions_bench import run_typed

        with prelude_server(["--dtype", args.dtype, *args.server_args.split()]) as base:
            typed = run_typed(base, args.seed, args.typed_input_tokens, args.iters, args.typed_concurrency,
                              args.typed_inputs)
        write_json(args.json, {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "typed_decisions": typed})
        return 0
    if args.tokenize_only:
        gain = prefix_encode_gain(400, args.seed)
        m = gain["median_us"]
        print(f"admission tokenization (render + encode), 2,000-token system prompt + 40-token user turn: "
              f"full {m['chat_full']:.0f} us, prefix memo {m['chat_memo']:.0f} us ({gain['chat_speedup']:.1f}x); "
              f"300-token /v1/score query: full {m['query_full']:.0f} us, memo {m['query_memo']:.0f} us "
              f"({gain['query_speedup']:.1f}x)")
        write_json(args.json, {"prefix_encode": gain})
        return 0
    if args.mixed_only:
        mixed = _mixed(args)
        write_json(args.json, {"dtype": args.dtype, "fused_vs_alternating": mixed})
        return 0
    mask = mask_cost(args.dtype, 8, 40)
    print(f"structured outputs, batch 8: decode step {mask['decode_step_ms_p50']:.1f} ms, masks "
          f"{mask['mask_compute_ms_p50']:.2f} ms + apply {mask['mask_apply_ms_p50']:.2f} ms = "
          f"{100 * mask['mask_over_step']:.1f}% of a step (<= 10%)")
    if args.mask_only:
        write_json(args.json, {"structured_mask_cost": mask})
        return 0
    work = Workload(args.seed, args.query_tokens, args.item_tokens, args.items, args.prompt_tokens)
    modes = ["multi-item", "rows", "separate"]
    with prelude_server(["--dtype", args.dtype, *args.server_args.split()]) as base:
        c1 = asyncio.run(scoring_c1(base, work, modes, args.iters))
        cn = asyncio.run(scoring_concurrent(base, work, modes, args.concurrency, args.queries, args.rounds))
        cls, labels = asyncio.run(classify_c1(base, work, args.iters))
    n = args.items
    scoring = {
        mode: {
            "c1_query_ms_p50": 1000 * _median(c1[mode]),
            "c1_items_per_s": n / _median(c1[mode]),
            f"c{args.concurrency}_items_per_s": _median(cn[mode]),
            "c1_samples_s": c1[mode],
            f"c{args.concurrency}_rounds_items_per_s": cn[mode],
        }
        for mode in modes
    }
    unit = _median(cls["one forward"])
    classify = {mode: {"p50_ms": 1000 * _median(v), "over_one_forward": _median(v) / unit, "samples_s": v}
                for mode, v in cls.items()}
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": args.dtype,
        "workload": {"query_tokens": args.query_tokens, "items": n, "item_tokens": args.item_tokens,
                     "classify_prompt_tokens": args.prompt_tokens, "labels": labels,
                     "concurrency": args.concurrency},
        "scoring": scoring,
        "classify": classify,
        "structured_mask_cost": mask,
        "goals": {
            "multi_item_over_separate_c1": scoring["multi-item"]["c1_items_per_s"] / scoring["separate"]["c1_items_per_s"],
            "whole_label_over_one_forward": classify["whole-label packed"]["over_one_forward"],
        },
    }
    c = args.concurrency
    print(f"scoring: query {args.query_tokens} + {n} items x {args.item_tokens} tokens (prefix cache on)")
    print(f"{'mode':<14}{'c=1 ms/query':>14}{'c=1 items/s':>13}{f'c={c} items/s':>15}")
    for mode in modes:
        s = scoring[mode]
        print(f"{mode:<14}{s['c1_query_ms_p50']:>14.1f}{s['c1_items_per_s']:>13.1f}{s[f'c{c}_items_per_s']:>15.1f}")
    print(f"classify: {args.prompt_tokens}-token prompt, labels {labels}")
    for mode, s in classify.items():
        print(f"{mode:<22}{s['p50_ms']:>10.1f} ms {s['over_one_forward']:>7.2f}x one forward")
    g = result["goals"]
    print(f"goals: multi-item / separate at c=1 = {g['multi_item_over_separate_c1']:.2f}x (>= 2); "
          f"whole-label / one forward = {g['whole_label_over_one_forward']:.2f}x (<= 1.3)")
    result["fused_vs_alternating"] = _mixed(args)
    write_json(args.json, result)
    return 0


def _mixed(args: argparse.Namespace) -> dict[str, Any]:
    from prelude.bench.fused_bench import print_mixed, run_mixed

    mixed = run_mixed(args.dtype, args.mixed_rounds, args.mixed_seconds, args.mixed_streams, args.mixed_chat_tokens,
                      args.mixed_output_tokens, args.mixed_classify_tokens, args.mixed_rate, args.seed)
    print_mixed(mixed)
    return mixed


if __name__ == "__main__":
    raise SystemExit(main())
