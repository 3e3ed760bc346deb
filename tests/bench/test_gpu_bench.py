"""The GPU benchmark's pieces that run anywhere: random-weight model dirs from configs,
the forward floor, and the goals table. The full run needs CUDA (`gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prelude.bench.gpu_bench import baseline_env, gpu_goals, graph_floor
from prelude.testing.random_model import SHAPES, random_model_dir


def test_random_model_dir_loads_and_generates(tmp_path: Path) -> None:
    from prelude import LLM, SamplingParams

    d = random_model_dir("qwen3-tiny", tmp_path)
    assert random_model_dir("qwen3-tiny", tmp_path) == d  # built once
    llm = LLM(model=str(d), dtype="float32", device="cpu", kv_cache_memory_gib=0.02, max_model_len=128)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3
    assert SHAPES["qwen3-4b"]["num_hidden_layers"] == 36 and SHAPES["qwen3-0.6b"]["hidden_size"] == 1024


def test_forward_floor_on_the_cpu(tmp_path: Path) -> None:
    d = random_model_dir("qwen3-tiny", tmp_path)
    floor = graph_floor(d, "cpu", "torch", [list(range(1, 33)), list(range(5, 40))], iters=3)
    assert floor["short_rows"] == 1 and floor["batched_rows"] == 2
    assert 0 < floor["short_p50_ms"] and 0 < floor["batched_p50_ms"]


def test_prelude_base_imports_the_other_checkout_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/carried/wheels")
    (tmp_path / "prelude").mkdir()
    env = baseline_env(str(tmp_path))
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), "/carried/wheels"]  # its prelude first, the rest kept
    with pytest.raises(SystemExit, match="holds no prelude package"):
        baseline_env(str(tmp_path / "missing"))


def test_goals_report_met_short_and_not_run() -> None:
    r = {"a": {"prelude": {"e2e_p50_ms": 3.5}, "floor": {"short_p50_ms": 2.5}},
         "c": {"prelude": {"output_tok_s": 1000.0, "tpot_p50_ms": 2.0}}, "startup_s": {"prelude:qwen3-0.6b": 4.0}}
    status = {g["goal"]: g["status"] for g in gpu_goals(r)}
    assert status["(a) E2E p50 <= 4.0 ms"] == "met"
    assert status["(a) E2E - graph floor <= 1.5 ms"] == "met"
    assert status["(c) output tok/s >= 1,474"] == "short"
    assert status["(c) TPOT p50 <= 2.1 ms"] == "met"
    assert status["(b) peak req/s >= 186.7"] == "not run"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bench_smoke(tmp_path: Path) -> None:
    from prelude.bench.gpu_bench import main

    assert main(["--device", "cuda", "--small", "qwen3-tiny", "--large", "qwen3-tiny", "--requests", "8",
                 "--sweep", "1,4", "--out", str(tmp_path / "gpu")]) == 0
