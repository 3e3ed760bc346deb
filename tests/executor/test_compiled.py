"""Compiled decoder segments: the swap logic (fast, no compiler) and equality with the
eager path on a tiny model (slow: runs inductor and the C++ compiler)."""

import threading
from pathlib import Path

import pytest
import torch

from prelude.config import ExecutorConfig, ModelConfig
from prelude.executor.compiled import CompiledForwards, cache_key
from prelude.executor.runner import ModelRunner
from prelude import LLM, SamplingParams
from prelude.forward_batch import HeadSpec, OneShotBatch, OneShotRow, SampleSpec
from prelude.model.registry import config_for
from tests.engine.tiny import hf_tiny_llama, tiny_engine

CFG = ModelConfig("llama", 260, 64, 128, 2, 4, 2, 16)


def test_cache_key_separates_what_changes_the_compiled_code() -> None:
    base = cache_key(CFG, torch.float32, frozenset({"avx2"}))
    assert base == cache_key(CFG, torch.float32, frozenset({"avx2"}))
    assert base != cache_key(CFG, torch.bfloat16, frozenset({"avx2"}))
    assert base != cache_key(CFG, torch.float32, frozenset({"avx2", "avx512_f"}))
    assert base != cache_key(ModelConfig("llama", 260, 64, 128, 3, 4, 2, 16), torch.float32, frozenset({"avx2"}))


def test_serves_eagerly_until_a_bucket_is_ready_then_swaps(tmp_path: Path) -> None:
    release = threading.Event()
    seen: list[int] = []

    def example(num_tokens: int, segments: object) -> None:  # stands in for a compiling forward
        release.wait(60)
        seen.append(num_tokens)

    def forward(*args: object, **kw: object) -> str:
        return "eager" if "segments" not in kw else "compiled"

    fw = CompiledForwards(forward, CFG, torch.float32, example, tmp_path)
    fw.start()
    assert fw.forward_for(1)() == "eager" and fw.forward_for(300)() == "eager"
    release.set()
    assert fw.wait(60)
    assert fw.forward_for(1)() == "compiled" and fw.forward_for(300)() == "compiled"
    assert sorted(seen) == [1, 16] and fw.status.error is None
    assert fw.cache_dir.is_dir() and fw.cache_dir.parent == tmp_path / "compiled"


def test_a_failed_compile_keeps_serving_eagerly(tmp_path: Path) -> None:
    def example(num_tokens: int, segments: object) -> None:
        raise RuntimeError("no C++ compiler")

    fw = CompiledForwards(lambda *a, **k: "eager", CFG, torch.float32, example, tmp_path)
    fw.start()
    assert not fw.wait(60)
    assert fw.forward_for(5)() == "eager" and "no C++ compiler" in (fw.status.error or "")


def test_unknown_compile_mode_is_refused() -> None:
    hf = hf_tiny_llama()
    config = config_for(hf.config.to_dict())
    with pytest.raises(ValueError, match="compile mode"):
        ModelRunner.create(config, dict(hf.state_dict()), ExecutorConfig(device="cpu", dtype="float32",
                                                                          compile="always"), 4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_runner_prepacks_eager_cpu_weights_and_keeps_them_plain_for_compiling() -> None:
    hf = hf_tiny_llama()
    config = config_for(hf.config.to_dict())

    def runner(compile: str) -> ModelRunner:
        return ModelRunner.create(config, dict(hf.state_dict()), ExecutorConfig(device="cpu", dtype="float32",
                                                                                 compile=compile), 4)

    eager = runner("off")
    assert not eager.model.weights_are_plain  # eager float32: oneDNN-prepacked projections
    compiling = runner("background")
    assert compiling.model.weights_are_plain  # what the compiled segments take
    assert isinstance(compiling.forwards, CompiledForwards)  # (compiling starts only with the engine)


@pytest.mark.slow
def test_compiled_forward_matches_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))
    hf = hf_tiny_llama()
    eager, compiled = tiny_engine(hf), tiny_engine(hf, compile="ahead")
    fw = compiled.runner.forwards
    assert isinstance(fw, CompiledForwards) and fw.wait(0) and fw.status.error is None
    assert any((tmp_path / "compiled").rglob("*.so")), "no compiled kernels in the disk cache"
    # Greedy tokens identical over prefill, chunked and decode steps of several batch shapes.
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9, 30, 1, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [r.outputs[0].token_ids for r in LLM(engine=eager).generate(prompts, params)]
    got = [r.outputs[0].token_ids for r in LLM(engine=compiled).generate(prompts, params)]
    assert got == want
    # Logits within float32 reordering tolerance, computed by compiled code (no silent eager fallback).
    for n in (1, 23):
        ids = list(range(7, 7 + n))  # a row as served: it samples, and its prompt logprobs read every position
        batch = OneShotBatch((OneShotRow("x", ids, SampleSpec(params, ids, []), HeadSpec(prompt_logprobs=0)),))
        with torch.inference_mode(), torch.profiler.profile() as prof:
            h_c = compiled.runner.trunk(batch)[0]
        assert any(e.key.startswith("Torch-Compiled Region") for e in prof.key_averages())
        with torch.inference_mode():
            h_e = eager.runner.trunk(batch)[0]
        assert h_c.shape[0] == h_e.shape[0] == n
        torch.testing.assert_close(compiled.runner.model.compute_logits(h_c), eager.runner.model.compute_logits(h_e),
                                   rtol=1e-4, atol=1e-4)
    for engine in (eager, compiled):
        engine.check_integrity()
