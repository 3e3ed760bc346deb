"""GGUF checkpoints of llama.cpp's `qwen3moe`, `gemma3` and `qwen35` architectures served
through the registry: random-weight transformers models written as GGUF the way llama.cpp's
converter writes them (tests/model/gguf_writer.py), loaded with load_model_files, and run
against transformers: float32 files give transformers' greedy tokens and logits within
float tolerance; quantized files the logits of transformers over the dequantized weights.
The tokenizer and config rebuilt from the file's metadata are checked too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from prelude.config import ExecutorConfig
from prelude.executor.runner import ModelRunner
from prelude.kv.kv_manager import KVCacheManager
from prelude.model.loading.files import LoadedModel, load_model_files

from tests.model.gguf_writer import dequantized_like_file, write_gguf

transformers = pytest.importorskip("transformers")

F32, F16, BF16, Q8_0, Q4_0 = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                              gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0,
                              gguf.GGMLQuantizationType.Q4_0)


def _load(model: Any, arch: str, qtype: gguf.GGMLQuantizationType, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> LoadedModel:
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(model, arch, tmp_path / f"{arch}-{qtype.name}.gguf", qtype)
    return load_model_files(str(path))


def _runner(loaded: LoadedModel, dtype: str = "float32") -> tuple[ModelRunner, KVCacheManager]:
    runner = ModelRunner.create(loaded.config, loaded.weights, ExecutorConfig(device="cpu", dtype=dtype), 4,
                                blocks=loaded.blocks)
    runner.allocate_kv_cache(64)
    return runner, KVCacheManager(64, 4)


# --- qwen3moe --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [F32, F16, Q8_0, Q4_0], ids=lambda q: q.name)
def test_qwen3moe_gguf_equals_transformers(qtype: gguf.GGMLQuantizationType, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.model.test_qwen3_moe import _prefill_then_decode, hf_moe

    # llama.cpp's qwen3moe: every layer a mixture, top-k weights renormalized
    hf = hf_moe(norm_topk_prob=True, mlp_only_layers=[])
    loaded = _load(hf, "qwen3moe", qtype, tmp_path, monkeypatch)
    assert loaded.config.architecture == "Qwen3MoeForCausalLM"
    assert loaded.config.moe.num_experts == 8 and loaded.config.moe.top_k == 2 and loaded.config.moe.norm_topk_prob
    if qtype in (Q8_0, Q4_0):  # experts and projections kept in their blocks for decode
        assert loaded.blocks["model.layers.0.mlp.experts.gate_up_proj"].kind == qtype.name.lower()
        assert loaded.blocks["model.layers.0.mlp.experts.down_proj"].out_features == 8 * 64
        for name in ("gate_up_proj", "down_proj"):
            w = loaded.weights[f"model.layers.0.mlp.experts.{name}"]
            assert torch.equal(loaded.blocks[f"model.layers.0.mlp.experts.{name}"].dequantize(),
                               w.reshape(-1, w.shape[-1]))
    dequantized_like_file(hf, "qwen3moe", qtype)
    runner, kv = _runner(loaded)
    _prefill_then_decode(hf, runner, kv, tol=1e-4 if qtype == F32 else 2e-4)
