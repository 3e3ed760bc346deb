"""Chat streams next to classify traffic: OneShot rows fused into the Decode/Mixed forward
vs steps alternating between a OneShot batch and a Decode/Mixed batch.

In process (no HTTP: the difference under test is the engine's step plan), two engines on
the same weights, one per mode, driven by the same seeded trace on the wall clock:
- `streams` closed-loop chat streams (a fresh prompt, greedy, fixed output length; the
  next request of a stream starts when its previous one ends);
- classify requests (a fresh prompt, two label ids: one OneShot row each) arriving as a
  Poisson process at `rate` per second, latency counted from the scheduled arrival.
A trial runs `duration` seconds of arrivals, then drains; the modes alternate trial by
trial (order flipped every round). Per trial: decode TPOT P50/P99 over requests, the
inter-token gap P99, OneShot E2E P50/P99; the table shows medians over rounds.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

MODES = ("fused", "alternating")


@dataclass
class Trace:
    """Prompts and arrival offsets, generated once and replayed for every trial."""

    stream_prompts: list[list[list[int]]]  # [stream][k] token ids
    classify: list[tuple[float, list[int]]]  # (arrival offset s, token ids)


@dataclass
class TrialResult:
    tpot_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    oneshot_e2e_s: list[float] = field(default_factory=list)
    decode_requests: int = 0
    steps: int = 0
    wall_s: float = 0.0


def make_trace(tok: Any, seed: int, streams: int, chat_tokens: int, classify_tokens: int, rate: float,
               duration: float) -> Trace:
    from prelude.bench.prompts import exact_prompt

    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return tok.encode(exact_prompt(n, rng, tok), add_special_tokens=False)

    per_stream = 64  # more than a trial can use
    prompts = [[ids(chat_tokens) for _ in range(per_stream)] for _ in range(streams)]
    arrivals: list[tuple[float, list[int]]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        arrivals.append((t, ids(classify_tokens)))
    if not arrivals:  # a comparison without OneShot traffic would compare nothing
        raise ValueError(f"no classify request arrives in {duration} s at {rate}/s: raise the rate or the duration")
    return Trace(prompts, arrivals)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_trial(engine: Any, trace: Trace, duration: float, output_tokens: int, label_ids: tuple[int, int],
              tag: str) -> TrialResult:
    """Replay `trace` on `engine` against the wall clock; requests finished after the
    arrivals stop are still counted (the trial drains)."""
    from prelude.params import PoolingParams, PoolingTask, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    no_gen = SamplingParams(max_tokens=0)
    labels = PoolingParams(PoolingTask.LABELS, label_token_ids=label_ids)
    res = TrialResult()
    next_prompt = [0] * len(trace.stream_prompts)
    active: dict[int, str] = {}  # stream -> request id
    token_times: dict[str, list[float]] = {}
    arrival: dict[str, float] = {}
    pending = list(trace.classify)
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        open_ = now < duration
        while pending and pending[0][0] <= now:
            at, ids = pending.pop(0)
            rid = f"{tag}-c{len(arrival)}"
            arrival[rid] = at
            engine.add_request(rid, ids, no_gen, labels)
        if open_:
            for s, prompts in enumerate(trace.stream_prompts):
                if s not in active and next_prompt[s] < len(prompts):  # a fast machine can use them all
                    rid = f"{tag}-s{s}-{next_prompt[s]}"
                    engine.add_request(rid, prompts[next_prompt[s]], greedy)
                    next_prompt[s] += 1
                    active[s] = rid
                    token_times[rid] = []
        if not engine.has_unfinished():
            if not pending and not open_:
                break
            time.sleep(max(0.0, pending[0][0] - now) if pending else 0.001)
            continue
        outs = engine.step()
        res.steps += 1
        stamp = time.perf_counter() - t0
        for out in outs:
            rid = out.request_id
            if rid in token_times:
                token_times[rid].extend([stamp] * len(out.new_token_ids))
                if out.finished:
                    stream = next(s for s, r in active.items() if r == rid)
                    del active[stream]
            elif out.finished:
                res.oneshot_e2e_s.append(stamp - arrival[rid])
    res.wall_s = time.perf_counter() - t0
    for times in token_times.values():
        if len(times) < 2:
            continue
        res.decode_requests += 1
        res.tpot_s.append((times[-1] - times[0]) / (len(times) - 1))
        res.gaps_s.extend(b - a for a, b in zip(times, times[1:]))
    engine.check_integrity()
    return res


def summarize(r: TrialResult) -> dict[str, float]:
    return {
        "tpot_ms_p50": 1000 * _pct(r.tpot_s, 0.5), "tpot_ms_p99": 1000 * _pct(r.tpot_s, 0.99),
        "itl_ms_p99": 1000 * _pct(r.gaps_s, 0.99),
        "oneshot_e2e_ms_p50": 1000 * _pct(r.oneshot_e2e_s, 0.5),
        "oneshot_e2e_ms_p99": 1000 * _pct(r.oneshot_e2e_s, 0.99),
        "oneshot_done": len(r.oneshot_e2e_s), "decode_requests": r.decode_requests, "steps": r.steps,
        "wall_s": r.wall_s,
    }


def run_mixed(dtype: str, rounds: int, duration: float, streams: int, chat_tokens: int, output_tokens: int,
              classify_tokens: int, rate: float, seed: int) -> dict[str, Any]:
    from dataclasses import replace

    from prelude.config import EngineConfig, ExecutorConfig, SchedulerConfig
    from prelude.engine.engine import LLMEngine
    from prelude.executor.runner import ModelRunner

    base = EngineConfig(executor=ExecutorConfig(dtype=dtype))
    first = LLMEngine.from_config(replace(base, scheduler=SchedulerConfig(fuse_oneshot=True)))
    # the second engine shares the first one's model (weights are read-only in a forward)
    runner = ModelRunner(first.runner.model, first.runner.block_size, first.runner.config)
    second = LLMEngine(runner, first.tokenizer, replace(base, scheduler=SchedulerConfig(fuse_oneshot=False)),
                       first.model_name)
    engines = {"fused": first, "alternating": second}
    tok = first.tokenizer
    label_ids = (tok.encode(" yes", add_special_tokens=False)[0], tok.encode(" no", add_special_tokens=False)[0])
    trace = make_trace(tok, seed, streams, chat_tokens, classify_tokens, rate, duration)
    for mode in MODES:  # warm-up: one short trial each, not counted
        run_trial(engines[mode], Trace(trace.stream_prompts, trace.classify[:3]), min(3.0, duration), 4,
                  label_ids, f"warm-{mode}")
    trials: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for rnd in range(rounds):
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            r = run_trial(engines[mode], trace, duration, output_tokens, label_ids, f"r{rnd}-{mode}")
            trials[mode].append(summarize(r))
            s = trials[mode][-1]
            print(f"  round {rnd} {mode:<12} TPOT p99 {s['tpot_ms_p99']:.0f} ms, ITL p99 {s['itl_ms_p99']:.0f} ms, "
                  f"OneShot E2E p50/p99 {s['oneshot_e2e_ms_p50']:.0f}/{s['oneshot_e2e_ms_p99']:.0f} ms "
                  f"({s['oneshot_done']} classify, {s['decode_requests']} chats, {s['steps']} steps)", flush=True)
    keys = ("tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99", "oneshot_e2e_ms_p50", "oneshot_e2e_ms_p99")
    medians = {m: {k: statistics.median(t[k] for t in trials[m]) for k in keys} for m in MODES}
    return {
        "workload": {"streams": streams, "chat_prompt_tokens": chat_tokens, "output_tokens": output_tokens,
                     "classify_prompt_tokens": classify_tokens, "classify_rate_per_s": rate,
                     "trial_s": duration, "rounds": rounds, "classify_per_trial": len(trace.classify)},
        "medians": medians,
        "trials": trials,
    }


def print_mixed(result: dict[str, Any]) -> None:
    w, med = result["workload"], result["medians"]
    print(f"mixed: {w['streams']} chat streams ({w['chat_prompt_tokens']} in / {w['output_tokens']} out) + classify "
          f"({w['classify_prompt_tokens']} tokens, {w['classify_rate_per_s']}/s), {w['rounds']} rounds of "
          f"{w['trial_s']:.0f} s, medians")
    print(f"{'mode':<13}{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>10}{'E2E p50':>10}{'E2E p99':>10}  (ms)")
    for mode in MODES:
        m = med[mode]
        print(f"{mode:<13}{m['tpot_ms_p50']:>10.1f}{m['tpot_ms_p99']:>10.1f}{m['itl_ms_p99']:>10.1f}"
              f"{m['oneshot_e2e_ms_p50']:>10.1f}{m['oneshot_e2e_ms_p99']:>10.1f}")
