"""`prelude bench serve --rounds`: the peer order per round, medians and per-round ratios,
the goals and report reading them, and fresh prompts every round (no servers, no model)."""

import argparse
import json
import math
import re

import pytest

from prelude.bench.report import markdown
from prelude.bench.serve_bench import (
    RATIO_METRICS,
    Workload,
    build_workload,
    combine_rounds,
    goals,
    in_rounds,
    round_order,
)
from tests.bench.test_prompts_and_report import _result, _summary


class WordTokenizer:
    """One token a word and one a newline: enough for prompts.py's exact lengths."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        for w in re.findall(r"\S+|\n", text):
            if w not in self.ids:
                self.ids[w] = len(self.words)
                self.words.append(w)
        return [self.ids[w] for w in re.findall(r"\S+|\n", text)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i] for i in ids)


def _args(rounds: int) -> argparse.Namespace:
    return argparse.Namespace(seed=0, suffix_range="4,8", prefix_tokens=24, rounds=rounds)


SIZES = {"a": 3, "b": 4, "c": 5, "d": 2, "e": 6}


def test_the_peer_order_alternates_between_rounds() -> None:
    names = ["prelude", "vllm", "llama.cpp"]
    assert round_order(names, 0) == names
    assert round_order(names, 1) == ["llama.cpp", "vllm", "prelude"]
    assert round_order(names, 2) == names
    calls: list[tuple[int, str]] = []

    def run(r: int, name: str) -> dict:
        calls.append((r, name))
        return _summary(req_s=float(10 * r + len(calls)))

    per_round = in_rounds(names, 3, run)
    assert calls == [(0, "prelude"), (0, "vllm"), (0, "llama.cpp"), (1, "llama.cpp"), (1, "vllm"), (1, "prelude"),
                     (2, "prelude"), (2, "vllm"), (2, "llama.cpp")]
    # Each round's summaries come back in the given peer order, whatever order they ran in.
    assert [list(r) for r in per_round] == [names] * 3
    assert per_round[1]["prelude"]["req_s"] == 16.0 and per_round[1]["llama.cpp"]["req_s"] == 14.0


def test_one_round_keeps_the_single_figures_exactly() -> None:
    one = {"prelude": _summary(req_s=2.0), "vllm": _summary(req_s=1.0)}
    assert combine_rounds([one], RATIO_METRICS["e"]) == {"peers": one}


def test_rounds_give_medians_and_ratios_taken_within_each_round() -> None:
    # The machine drifts: round 1 is fast for both, round 2 slow for both.
    per_round = [
        {"prelude": _summary(req_s=2.0, e2e_p50_ms=100.0), "vllm": _summary(req_s=1.0, errors=1, first_error="boom")},
        {"prelude": _summary(req_s=6.0, e2e_p50_ms=300.0), "vllm": _summary(req_s=5.0)},
        {"prelude": _summary(req_s=1.2, e2e_p50_ms=200.0), "vllm": _summary(req_s=0.4)},
    ]
    out = combine_rounds(per_round, ("req_s",))
    pre, vllm = out["peers"]["prelude"], out["peers"]["vllm"]
    assert pre["req_s"] == 2.0 and vllm["req_s"] == 1.0  # medians of 2/6/1.2 and 1/5/0.4
    assert pre["e2e_p50_ms"] == 200.0
    assert pre["requests"] == 30 and vllm["errors"] == 1 and vllm["first_error"] == "boom"
    assert math.isnan(pre["tpot_p50_ms"])  # no round measured one: still not measured
    assert pre["rounds"] == [r["prelude"] for r in per_round]
    assert out["ratio_rounds"] == {"req_s": {"vllm": pytest.approx([2.0, 1.2, 3.0])}}
    assert out["ratio_median"] == {"req_s": {"vllm": 2.0}}
    # The median of the per-round ratios, not the ratio of the medians (2.0 / 1.9 = 1.05).
    per_round[0]["vllm"]["req_s"] = 1.9  # per-round ratios 1.05, 1.2, 3.0
    out = combine_rounds(per_round, ("req_s",))
    assert out["ratio_median"]["req_s"]["vllm"] == 1.2


def test_a_round_without_a_figure_is_left_out_of_the_ratio_median() -> None:
    per_round = [{"prelude": _summary(req_s=2.0), "vllm": _summary(req_s=0.0)},
                 {"prelude": _summary(req_s=3.0), "vllm": _summary(req_s=2.0)}]
    out = combine_rounds(per_round, ("req_s",))
    assert out["ratio_rounds"]["req_s"]["vllm"] == [None, 1.5] and out["ratio_median"]["req_s"]["vllm"] == 1.5
    assert "ratio_rounds" not in combine_rounds([{"vllm": _summary()}, {"vllm": _summary()}], ("req_s",))


def _rounds_result() -> dict:
    """(b) at c=16, (c) and (e) over three rounds, where the ratio of the medians and the
    median of the per-round ratios fall on either side of the goals."""
    result = _result()
    sc = result["scenarios"]
    b = combine_rounds([{"prelude": _summary(req_s=p), "vllm": _summary(req_s=v)}
                        for p, v in ((1.0, 1.1), (3.0, 2.0), (5.0, 4.0))], RATIO_METRICS["b"])
    sc["b"]["points"]["16"] = b["peers"]
    sc["b"]["ratio_rounds"], sc["b"]["ratio_median"] = {"16": b["ratio_rounds"]}, {"16": b["ratio_median"]}
    sc["c"] = combine_rounds([{"prelude": _summary(output_tok_s=p), "llama.cpp": _summary(output_tok_s=l),
                               "vllm": _summary(output_tok_s=v)}
                              for p, l, v in ((60.0, 70.0, 40.0), (50.0, 40.0, 45.0), (90.0, 80.0, 80.0))],
                             RATIO_METRICS["c"])
    sc["e"] = {"prefix_tokens": 1024, "suffix_range": [64, 64], "max_tokens": 1, "concurrency": 16} | combine_rounds(
        [{"prelude": _summary(req_s=p), "vllm": _summary(req_s=v)} for p, v in ((3.0, 2.0), (1.6, 1.0), (9.0, 5.0))],
        RATIO_METRICS["e"])
    result["rounds"] = 3
    result["startup_s"]["vllm"] = 40.0
    return result


def test_goals_read_the_median_of_the_per_round_ratios() -> None:
    result = _rounds_result()
    rows = {g["goal"]: g for g in goals(result)}
    # (b) c=16: medians 3.0 / 2.0 = 1.5 would meet 1.2; per round 0.91, 1.5, 1.25: median 1.25.
    assert rows["512/1 c=16: prelude req/s / vllm >= 1.2"]["measured"] == "1.25x"
    assert rows["issue 24: 512/1 c=16: prelude req/s / vllm >= 1.1"]["status"] == "met"
    # (e): medians 3.0 / 2.0 = 1.5; per round 1.5, 1.6, 1.8: median 1.6.
    assert rows["issue 24: judge (e): prelude req/s / vllm >= 1.5"] == {
        "goal": "issue 24: judge (e): prelude req/s / vllm >= 1.5", "measured": "1.60x", "status": "met"}
    # (c) against llama.cpp: medians 60 / 70 = 0.86 (short); per round 0.86, 1.25, 1.125: 1.125 (met).
    assert rows["decode 128/32 c=4: prelude output tok/s / llama.cpp >= 1"]["measured"] == "1.12x"
    assert rows["decode 128/32 c=4: prelude output tok/s / llama.cpp >= 1"]["status"] == "met"
    # Goals that are not peer ratios read the medians.
    assert rows["issue 24: 512/1 c=16: prelude req/s >= 0.85x the GEMM roofline"]["measured"] == "1.20x"  # 3 / 2.5


def test_markdown_shows_the_rounds_beside_the_medians() -> None:
    result = _rounds_result()
    result["goals"] = goals(result)
    text = markdown(result)
    assert "sweep: req/s (E2E p50 / p95 ms), median of 3 rounds" in text
    assert "c=4, median of 3 rounds" in text and "c=16, median of 3 rounds" in text
    assert "| 16 | vllm | 1.10, 2.00, 4.00 | 0.91x, 1.50x, 1.25x (median 1.25x) |" in text
    assert "| vllm | 2.00, 1.00, 5.00 | 1.50x, 1.60x, 1.80x (median 1.60x) |" in text
    assert "| llama.cpp | 70.00, 40.00, 80.00 | 0.86x, 1.25x, 1.12x (median 1.12x) |" in text
    assert "the median of 3 per-round ratios" in text
    assert markdown(json.loads(json.dumps(result))).count("|") == text.count("|")
    # Without rounds, none of it.
    plain = _result()
    plain["goals"] = goals(plain)
    assert "round" not in markdown(plain)


def test_every_round_has_fresh_prompts_and_round_0_is_the_single_rounds() -> None:
    one = build_workload(WordTokenizer(), SIZES, [1, 4, 8], _args(1))
    assert one.sweep_rounds == [one.sweep] and one.decode_rounds == [one.short[SIZES["a"]:]]
    assert one.prefix_rounds == [(one.prefix_prompts, one.prefix_lengths)]
    tok = WordTokenizer()
    three = build_workload(tok, SIZES, [1, 4, 8], _args(3))
    # Round 0 (and everything outside the rounds) is what a single-round run gets.
    for field in ("short", "sweep", "warm_short", "warm_long", "texts", "prefix_prompts", "prefix_lengths"):
        assert getattr(three, field) == getattr(one, field), field
    assert len(three.sweep_rounds) == len(three.decode_rounds) == len(three.prefix_rounds) == 3
    systems = [prompts[0].split("\n", 1)[0] for prompts, _ in three.prefix_rounds]
    assert len(set(systems)) == 3  # a fresh shared prefix every round: every round's first wave is cold
    for prompts, lengths in three.prefix_rounds:
        system = prompts[0].split("\n", 1)[0] + "\n"
        assert len(prompts) == SIZES["e"] and all(p.startswith(system) for p in prompts)
        assert all(len(tok.encode(p)) == n and 24 + 4 <= n <= 24 + 8 for p, n in zip(prompts, lengths))
    for c, n in ((1, 4), (4, 4), (8, 8)):  # at least as many as the concurrency
        rounds = [r[c] for r in three.sweep_rounds]
        assert all(len(r) == n and all(len(tok.encode(p)) == 512 for p in r) for r in rounds)
        assert len({p for r in rounds for p in r}) == 3 * n  # no prompt seen by an earlier round
    decode = [p for r in three.decode_rounds for p in r]
    assert len(decode) == 3 * SIZES["c"] and len(set(decode)) == len(decode)
    assert all(len(tok.encode(p)) == 128 for p in decode)


class _FakeRaw:
    """RawModel's calls run_scenarios makes for (b) and (e), without a model."""

    dense = True

    def __init__(self) -> None:
        self.waves: list[tuple[list[list[int]], int]] = []

    def batched(self, ids: list[list[int]], iters: int) -> dict[int, float]:
        return {1: 1.0}

    def roofline(self, tokens: int) -> tuple[float, float]:
        return 1e9, 2.0

    def waves_req_s(self, prompts: list[list[int]], wave: int) -> float:
        self.waves.append(([list(p) for p in prompts], wave))
        return 40.0 + 10.0 * len(self.waves)  # 50 req/s in round 0, 60 in round 1


def _fake_run(monkeypatch: pytest.MonkeyPatch, rounds: int, raw: _FakeRaw | None = None,
              ceiling: bool = True) -> tuple[dict, list[tuple[str, list]], Workload]:
    """run_scenarios' (b), (c) and (e) for prelude (2x faster) and vllm, run_load faked:
    (its results, each run's (progress label, payloads), the workload). `ceiling` False:
    no in-process references, as `--no-ceiling` runs."""
    import contextlib

    from prelude.bench import serve_bench
    from prelude.bench.loadgen import LoadResult, Record
    from prelude.bench.peers.launch import COMPLETIONS, PeerSpec

    runs: list[tuple[str, list]] = []
    speed = {"prelude": 2.0, "vllm": 1.0}

    async def fake_run_load(send, payloads, spec, warm=(), client=None) -> LoadResult:  # noqa: ANN001
        runs.append((spec.progress, list(payloads)))
        name = next(n for n in speed if n in spec.progress.split())
        return LoadResult([Record(True, 0.1, 0.05, 32, 32) for _ in payloads], len(payloads) / speed[name])

    monkeypatch.setattr(serve_bench, "run_load", fake_run_load)
    monkeypatch.setattr(serve_bench, "_settle", lambda peers: None)
    monkeypatch.setattr(serve_bench, "alone", lambda peers, p=None: contextlib.nullcontext())
    tok = WordTokenizer()
    args = argparse.Namespace(**vars(_args(rounds)), client="httpx", ceiling_iters=3, llama_sweep_max=16, rate=None,
                              warmup=0, no_progress=False, prefix_max_tokens=1, prefix_concurrency=4)
    wl = build_workload(tok, SIZES, [1, 4], args)
    peers = [serve_bench.Peer(PeerSpec(n, (), "/health", None, frozenset({COMPLETIONS})), "http://x", 0.0)
             for n in ("prelude", "vllm")]
    out, _ = serve_bench.run_scenarios(peers, wl, args, {"b", "c", "e"}, (raw or _FakeRaw()) if ceiling else None, tok)
    return out, runs, wl


def test_without_the_ceiling_the_judge_reports_each_peers_cache_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-ceiling runs every scenario with no model in process; the judge reads each
    server's prefix-cache counters before and after its run: Prelude's reused/computed
    tokens, vLLM's token-counted hits/queries."""
    from prelude.bench import serve_bench

    scrapes: list[str] = []

    def fake_scrape(base: str) -> dict[str, float]:
        scrapes.append(base)
        n = len(scrapes)  # each peer's run: a scrape before (odd n) and after (even n)
        if n % 4 in (1, 2):  # prelude runs first in round 0
            return {"prefix_cache_reused_tokens_total": 900.0 * (n % 4 == 2),
                    "prefix_cache_computed_tokens_total": 100.0 * (n % 4 == 2)}
        return {"prefix_cache_hits_total": 300.0 * (n % 4 == 0), "prefix_cache_queries_total": 1000.0 * (n % 4 == 0)}

    monkeypatch.setattr(serve_bench, "scrape_metrics", fake_scrape)
    out, _, _ = _fake_run(monkeypatch, 1, ceiling=False)
    peers = out["e"]["peers"]
    assert peers["prelude"]["prefix_hit_fraction"] == pytest.approx(0.9)
    assert peers["vllm"]["prefix_hit_fraction"] == pytest.approx(0.3)
    assert "in_process_req_s" not in peers["prelude"]
    assert out["b"]["ceiling_req_s"] == {}


def test_prefix_hit_tokens_reads_either_servers_counters() -> None:
    from prelude.bench.server_proc import prefix_hit_tokens

    prelude = ({"prefix_cache_reused_tokens_total": 10.0, "prefix_cache_computed_tokens_total": 5.0},
               {"prefix_cache_reused_tokens_total": 40.0, "prefix_cache_computed_tokens_total": 15.0})
    assert prefix_hit_tokens(*prelude) == (30.0, 40.0)
    vllm = ({"prefix_cache_hits_total": 0.0, "prefix_cache_queries_total": 0.0},
            {"prefix_cache_hits_total": 64.0, "prefix_cache_queries_total": 256.0})
    assert prefix_hit_tokens(*vllm) == (64.0, 256.0)
    assert prefix_hit_tokens({}, {}) is None


def test_run_scenarios_gives_every_round_its_own_prompts_in_alternating_order(monkeypatch: pytest.MonkeyPatch) -> None:
    out, runs, wl = _fake_run(monkeypatch, 2)
    labels = [label for label, _ in runs]
    assert labels == ["b c=1 prelude r0", "b c=1 vllm r0", "b c=1 vllm r1", "b c=1 prelude r1",
                      "b c=4 prelude r0", "b c=4 vllm r0", "b c=4 vllm r1", "b c=4 prelude r1",
                      "c prelude r0", "c vllm r0", "c vllm r1", "c prelude r1",
                      "e prelude r0", "e vllm r0", "e vllm r1", "e prelude r1"]
    got = dict(runs)
    for r in (0, 1):  # every peer gets the round's own prompts, the same as the other peer's
        assert got[f"b c=4 prelude r{r}"] == got[f"b c=4 vllm r{r}"] == wl.sweep_rounds[r][4]
        assert got[f"c prelude r{r}"] == got[f"c vllm r{r}"] == wl.decode_rounds[r]
        assert got[f"e prelude r{r}"] == got[f"e vllm r{r}"] == wl.prefix_rounds[r][0]
    assert out["b"]["ratio_rounds"]["4"] == {"req_s": {"vllm": [2.0, 2.0]}}
    assert out["e"]["ratio_median"] == {"req_s": {"vllm": 2.0}} and out["e"]["prefix_tokens"] == 24
    assert len(out["c"]["peers"]["vllm"]["rounds"]) == 2 and out["c"]["ratio_median"]["output_tok_s"]["vllm"] == 2.0


def test_run_scenarios_with_one_round_keeps_todays_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    out, runs, wl = _fake_run(monkeypatch, 1)
    assert [label for label, _ in runs] == ["b c=1 prelude", "b c=1 vllm", "b c=4 prelude", "b c=4 vllm",
                                            "c prelude", "c vllm", "e prelude", "e vllm"]
    assert dict(runs)["e vllm"] == wl.prefix_prompts and dict(runs)["c vllm"] == wl.short[wl.n_a:]
    assert set(out["b"]) == {"points", "ceiling_req_s"} and set(out["c"]) == {"peers"}
    assert list(out["e"]) == ["prefix_tokens", "suffix_range", "max_tokens", "concurrency", "peers"]
    assert not any("rounds" in s for sc in ("c", "e") for s in out[sc]["peers"].values())


def test_scenario_a_alternates_the_peers_order_prompt_by_prompt() -> None:
    """(a) interleaves the peers request by request after the raw forward of each prompt:
    the order flips every prompt, so no peer always runs right after the raw forward."""
    import asyncio

    from prelude.bench.serve_bench import Peer, interleaved_c1

    calls: list[tuple[str, str]] = []

    class Clients:
        def pool(self, base: str) -> None:
            return None

        def completions(self, base: str, model: str | None, max_tokens: int):  # noqa: ANN201
            async def send(client: object, prompt: str) -> str:
                calls.append((base, prompt))
                return prompt
            return send

    class Raw:
        def forward_seconds(self, prompts: list[list[int]], *_: object) -> list[float]:
            calls.append(("raw", ""))
            return [0.001 for _ in prompts]

    spec = argparse.Namespace(name="", model=None)
    peers = [Peer(argparse.Namespace(**vars(spec) | {"name": n}), n, 0.0) for n in ("prelude", "vllm")]
    prompts = ["p0", "p1", "p2"]
    res, raw_s = asyncio.run(interleaved_c1(peers, prompts, "warm", 0, Raw(), WordTokenizer(), 0.0, Clients()))
    measured = [c for c in calls if c[1] in prompts or c[0] == "raw"][1:]  # after the warm-up's raw forward
    assert measured == [("raw", ""), ("prelude", "p0"), ("vllm", "p0"),
                        ("raw", ""), ("vllm", "p1"), ("prelude", "p1"),
                        ("raw", ""), ("prelude", "p2"), ("vllm", "p2")]
    assert [len(r.records) for r in res.values()] == [3, 3] and len(raw_s) == 3


def test_the_judge_scenario_runs_cold_and_warm_waves_at_any_scale() -> None:
    from prelude.bench.serve_bench import JUDGE_WAVES, _sizes

    # 16 requests at c=16 were one wave: the cold prefix's only. Now JUDGE_WAVES waves, the
    # first cold and the rest on the cached prefix.
    assert _sizes(0.25, 16)["e"] == JUDGE_WAVES * 16 == 64
    assert _sizes(0.25, 4)["e"] == 16  # the scaled count where it already gives enough waves
    assert _sizes(4.0, 16)["e"] == 256
    assert _sizes(0.01, 1)["e"] == 8  # the floor


def test_the_judge_is_also_run_in_process_after_prelude_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _FakeRaw()
    out, runs, wl = _fake_run(monkeypatch, 2, raw)
    tok = WordTokenizer()
    # each round's own prompts, tokenized, a wave of the scenario's concurrency at a time
    assert [wave for _, wave in raw.waves] == [4, 4]
    for r, (ids, _) in enumerate(raw.waves):
        prompts = wl.prefix_rounds[r][0]
        assert len(ids) == len(prompts) and [len(i) for i in ids] == [len(tok.encode(p)) for p in prompts]
    pre = out["e"]["peers"]["prelude"]
    served = [rnd["req_s"] for rnd in pre["rounds"]]
    assert [rnd["in_process_req_s"] for rnd in pre["rounds"]] == [50.0, 60.0]
    assert [rnd["served_over_in_process"] for rnd in pre["rounds"]] == pytest.approx([served[0] / 50, served[1] / 60])
    assert "in_process_req_s" not in out["e"]["peers"]["vllm"]
    row = next(g for g in goals({"scenarios": out, "startup_s": {}}) if "in process" in g["goal"])
    assert row["measured"] == f"{pre['served_over_in_process']:.2f}x"
    assert row["status"] == ("met" if pre["served_over_in_process"] >= 0.95 else "short")


def test_waves_are_handed_over_a_wave_at_a_time_and_run_to_their_end() -> None:
    from prelude.bench.ceiling import _waves_req_s

    class Engine:
        def __init__(self) -> None:
            self.waiting: list[str] = []
            self.added: list[tuple[str, list[int]]] = []
            self.wave_sizes: list[int] = []

        def add_request(self, rid: str, ids: list[int], params: object) -> None:
            self.waiting.append(rid)
            self.added.append((rid, ids))

        def has_unfinished(self) -> bool:
            return bool(self.waiting)

        def step(self) -> None:  # finishes everything handed over so far in one step
            self.wave_sizes.append(len(self.waiting))
            self.waiting.clear()

    engine = Engine()
    prompts = [[i, i + 1] for i in range(10)]
    assert _waves_req_s(engine, prompts, 4) > 0
    assert engine.wave_sizes == [4, 4, 2]
    assert [ids for _, ids in engine.added] == prompts
    assert len({rid for rid, _ in engine.added}) == 10
