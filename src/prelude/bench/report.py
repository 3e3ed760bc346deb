"""Turns a `prelude bench serve` result into a markdown report and PNG plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

DASH = "—"


def _f(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return DASH
    return f"{x:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _errors(s: dict[str, Any]) -> str:
    return f"{s['errors']} ({s.get('first_error', '')[:60]})" if s.get("errors") else "0"


_METRIC_NAMES = {"req_s": "req/s", "output_tok_s": "output tok/s", "tpot_p50_ms": "TPOT p50 ms"}


def _n_rounds(peers: dict[str, dict[str, Any]]) -> int:
    """How many rounds a scenario's figures are the medians of (1: no --rounds)."""
    return max((len(s.get("rounds", [])) for s in peers.values()), default=0) or 1


def _median_of(n: int) -> str:
    return f", median of {n} rounds" if n > 1 else ""


def _by_round(peers: dict[str, dict[str, Any]], ratios: dict[str, Any], medians: dict[str, Any],
              metrics: list[str], lead: tuple[str, ...] = ()) -> list[list[str]]:
    """With --rounds, one row a peer: each metric's per-round figures, then prelude / peer
    per round (each taken within its round) and their median: the ratio the goals read."""
    rows: list[list[str]] = []
    for p, s in peers.items():
        if "rounds" not in s:
            continue
        row = [*lead, p]
        for m in metrics:
            row.append(", ".join(_f(r.get(m), 2) for r in s.get("rounds", [])))
            rs, med = ratios.get(m, {}).get(p), medians.get(m, {}).get(p)
            row.append(DASH if rs is None else ", ".join(DASH if x is None else _f(x, 2) + "x" for x in rs)
                       + f" (median {DASH if med is None else _f(med, 2) + 'x'})")
        rows.append(row)
    return rows


def _by_round_header(metrics: list[str], lead: tuple[str, ...] = ()) -> list[str]:
    cols = [*lead, "peer"]
    for m in metrics:
        name = _METRIC_NAMES.get(m, m)
        cols += [f"{name} by round", f"prelude / peer {name} by round (median)"]
    return cols


def markdown(result: dict[str, Any]) -> str:
    sc = result["scenarios"]
    lines = [f"# prelude bench serve — {result['when']}", "", f"Machine: {result['machine']}.",
             f"Command: `{result['command']}`", ""]
    if result.get("cpu"):
        lines += [f"Every figure: dtype | CPU flags = {result['cpu']}; load average at the start "
                  f"{result.get('load_average', 'unknown')}, at the end {result.get('load_average_end', 'unknown')}.", ""]
    if result.get("skipped"):
        lines += ["Skipped peers: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items()), ""]
    lines += ["## Startup to ready (process start to first 200 from its health route)", ""]
    cold = result.get("startup_cold_s", {})
    lines += _table(["peer", "warm s", "cold s (empty caches)"],
                    [[p, _f(s, 2), _f(cold.get(p), 2)] for p, s in result["startup_s"].items()]) + [""]
    ceiling = result.get("ceiling", {})
    if "a" in sc:
        n = next(iter(sc["a"]["peers"].values()), {}).get("requests", 0)
        lines += [f"## (a) OneShot 128-in/1-out, c=1, {n} requests per peer, interleaved", ""]
        pre = sc["a"]["peers"].get("prelude", {}).get("e2e_p50_ms")
        rows = []
        for p, s in sc["a"]["peers"].items():
            vs = _f(s["e2e_p50_ms"] / pre, 2) + "x" if pre and p != "prelude" else DASH
            rows.append([p, _f(s["ttft_p50_ms"]), _f(s["e2e_p50_ms"]), _f(s["e2e_p95_ms"]), _f(s["input_tok_s"], 0),
                         _f(s["rpm"], 0), vs, _errors(s)])
        if "forward_short_ms" in ceiling:
            rows.append(["Prelude eager forward (no server)", DASH, _f(ceiling["forward_short_ms"]), DASH, DASH, DASH, DASH, DASH])
        lines += _table(["peer", "TTFT p50 ms", "E2E p50 ms", "E2E p95 ms", "input tok/s", "RPM",
                         "E2E / prelude", "errors"], rows) + [""]
    if "b" in sc:
        points = sc["b"]["points"]
        peers = sorted({p for pt in points.values() for p in pt}, key=list(result["startup_s"]).index)
        n = max((_n_rounds(pt) for pt in points.values()), default=1)
        lines += [f"## (b) 512-in/1-out sweep: req/s (E2E p50 / p95 ms){_median_of(n)}", ""]
        at_point = sc["b"].get("ceiling_req_s", {})
        rows = []
        for c, pt in points.items():
            rows.append([str(c)] + [
                f"{_f(pt[p]['req_s'], 2)} ({_f(pt[p]['e2e_p50_ms'], 0)} / {_f(pt[p]['e2e_p95_ms'], 0)})"
                + (f" [{pt[p]['errors']} errors]" if pt[p].get("errors") else "") if p in pt else DASH
                for p in peers] + ([_f(at_point.get(c), 2)] if at_point else []))
        lines += _table(["concurrency", *peers] + (["Prelude eager forward (measured before the point)"]
                                                    if at_point else []), rows)
        if n > 1:
            ratios, medians = sc["b"].get("ratio_rounds", {}), sc["b"].get("ratio_median", {})
            lines += ["", f"Median of {n} rounds (fresh prompts every round, the peer order alternating); "
                      "per round:", ""]
            lines += _table(_by_round_header(["req_s"], ("concurrency",)),
                            [row for c, pt in points.items()
                             for row in _by_round(pt, ratios.get(c, {}), medians.get(c, {}), ["req_s"], (c,))])
        if "roofline_long_req_s" in ceiling:
            lines += ["", f"GEMM roofline (the machine's limit): {_f(ceiling['roofline_long_req_s'], 2)} req/s "
                      f"({_f(ceiling['gemm_gflops'], 0)} GFLOP/s at the model's layer shapes, 512 rows)."]
        if ceiling:
            lines += ["", f"Prelude's eager batched forward (no server; its own kernels, not the machine's limit): "
                      f"{_f(ceiling['best_long_req_s'], 2)} req/s, the best seen (at the start, by batch: "
                      + ", ".join(f"{b}: {_f(v, 2)}" for b, v in ceiling["batched_long_req_s"].items()) + ")"]
        lines += [""]
    if "c" in sc:
        n = _n_rounds(sc["c"]["peers"])
        lines += [f"## (c) Decode control 128-in/32-out, c=4{_median_of(n)}", ""]
        rows = [[p, _f(s["ttft_p50_ms"]), _f(s["tpot_p50_ms"]), _f(s["output_tok_s"]), _f(s["mean_output_tokens"]),
                 _errors(s)] for p, s in sc["c"]["peers"].items()]
        lines += _table(["peer", "TTFT p50 ms", "TPOT p50 ms", "output tok/s", "tokens/request", "errors"], rows)
        lines += _rounds_section(sc["c"], n, ["output_tok_s", "tpot_p50_ms"], " (fresh prompts every round)")
        lines += [""]
    for key, title in (("d_classify", "(d) Classify, c=16, 20 texts per request"),
                       ("d_embed", "(d) Embed, c=16, 20 texts per request")):
        if key in sc:
            lines += [f"## {title}", ""]
            rows = [[p, _f(s["items_s"]), _f(s["e2e_p50_ms"]), _f(s["e2e_p95_ms"]), _errors(s)]
                    for p, s in sc[key]["peers"].items()]
            lines += _table(["peer", "items/s", "E2E p50 ms", "E2E p95 ms", "errors"], rows) + [""]
    if "e" in sc:
        e = sc["e"]
        n = _n_rounds(e["peers"])
        lines += [f"## (e) Shared prefix: {e['prefix_tokens']}-token system prompt + {e['suffix_range'][0]}-"
                  f"{e['suffix_range'][1]} unique tokens, {e['max_tokens']} output token(s), c={e['concurrency']}"
                  f"{_median_of(n)}", ""]
        rows = [[p, _f(s["req_s"], 2), _f(s["ttft_p50_ms"], 0), _f(s["ttft_p95_ms"], 0), _f(s["e2e_p95_ms"], 0),
                 _f(s["input_tok_s"], 0),
                 _f(100 * s["prefix_hit_fraction"], 1) + "%" if "prefix_hit_fraction" in s else DASH, _errors(s)]
                for p, s in e["peers"].items()]
        lines += _table(["peer", "req/s", "TTFT p50 ms", "TTFT p95 ms", "E2E p95 ms", "input tok/s",
                         "prompt tokens from its cache (every wave)", "errors"], rows)
        lines += _rounds_section(e, n, ["req_s"], " (a fresh shared prefix every round: each round's first wave is cold)")
        if (pre := e["peers"].get("prelude", {})).get("in_process_req_s"):
            by_round = [r.get("served_over_in_process") for r in pre.get("rounds", [])]
            lines += ["", f"The same requests in process (a wave of {e['concurrency']} handed over at once, no HTTP, "
                      f"right after Prelude's served run): {_f(pre['in_process_req_s'], 2)} req/s; served / in "
                      f"process {_f(pre['served_over_in_process'], 2)}x"
                      + (f" ({', '.join(_f(x, 2) for x in by_round if x is not None)} by round)" if len(by_round) > 1 else "")]
        lines += [""]
    if result.get("goals"):
        rounds = result.get("rounds", 1)
        lines += ["## Goals (ratios from this run" + (f"; against a peer in (b), (c) and (e): the median of {rounds} "
                                                      "per-round ratios" if rounds > 1 else "") + ")", ""]
        lines += _table(["goal", "measured", "status"],
                        [[g["goal"], g["measured"], g["status"]] for g in result["goals"]]) + [""]
    return "\n".join(lines)


def _rounds_section(scenario: dict[str, Any], n: int, metrics: list[str], why: str = "") -> list[str]:
    """With --rounds: the per-round figures and ratios under a scenario's table of medians."""
    if n <= 1:
        return []
    rows = _by_round(scenario["peers"], scenario.get("ratio_rounds", {}), scenario.get("ratio_median", {}), metrics)
    return ["", f"Median of {n} rounds{why}, the peer order alternating; per round:", "",
            *_table(_by_round_header(metrics), rows)]


def plot_sweep(result: dict[str, Any], path: Path) -> Path | None:
    """Throughput and P50/P95 latency against concurrency for the 512-in/1-out sweep."""
    points = result["scenarios"].get("b", {}).get("points")
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = sorted({p for pt in points.values() for p in pt}, key=list(result["startup_s"]).index)
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in peers:
        runs = [(int(c), pt[p]) for c, pt in points.items() if p in pt]  # keys are str(concurrency)
        cs = [c for c, _ in runs]
        ax_t.plot(cs, [s["req_s"] for _, s in runs], marker="o", label=p)
        p50 = [s["e2e_p50_ms"] / 1000 for _, s in runs]
        p95 = [s["e2e_p95_ms"] / 1000 for _, s in runs]
        line, = ax_l.plot(cs, p50, marker="o", label=f"{p} P50")
        ax_l.plot(cs, p95, marker="x", linestyle="--", color=line.get_color(), label=f"{p} P95")
    ceiling = result.get("ceiling", {}).get("best_long_req_s")
    if ceiling:
        ax_t.axhline(ceiling, color="gray", linestyle=":", label="Prelude eager forward")
    roof = result.get("ceiling", {}).get("roofline_long_req_s")
    if roof:
        ax_t.axhline(roof, color="black", linestyle="--", label="GEMM roofline")
    for ax, title, ylabel in ((ax_t, "throughput", "requests/s"), (ax_l, "E2E latency", "seconds")):
        ax.set_xscale("log")
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(f"512-in/1-out {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
