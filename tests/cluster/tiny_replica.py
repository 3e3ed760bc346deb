"""Engine factories the replicas run (importable by Ray workers, so picklable by name).

The tiny model's weights are saved once by the test process; replicas load the file,
so a replica imports neither transformers nor rebuilds the HF model (seconds each)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import torch

from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
from prelude.engine.engine import LLMEngine
from prelude.executor.runner import ModelRunner
from prelude.model.registry import config_for

from tests.engine.tiny import VOCAB, ByteTokenizer, hf_tiny_llama


def _load(path: str, engine_kw: dict[str, Any]) -> LLMEngine:
    saved = torch.load(path)
    executor = ExecutorConfig(device="cpu", dtype="float32", attention_backend="torch")
    kw = {"num_blocks": 256, "block_size": 4, "max_model_len": 256, "max_num_batched_tokens": 64,
          "max_num_seqs": 16, **engine_kw}
    runner = ModelRunner.create(config_for(saved["config"]), saved["weights"], executor, kw["block_size"])
    cfg = EngineConfig(
        executor=executor,
        cache=CacheConfig(block_size=kw["block_size"], num_blocks=kw["num_blocks"]),
        scheduler=SchedulerConfig(
            max_num_seqs=kw["max_num_seqs"], max_num_batched_tokens=kw["max_num_batched_tokens"],
            max_model_len=kw["max_model_len"], policy=kw.get("policy", "fcfs"),
        ),
    )
    return LLMEngine(runner, ByteTokenizer(), cfg, "tiny-llama")


def tiny_factory(directory: Path, **engine_kw: Any) -> Callable[[], LLMEngine]:
    """A picklable factory for the tiny random Llama (tests/engine/tiny.py), saved under `directory`."""
    path = directory / "tiny-llama.pt"
    if not path.exists():
        hf = hf_tiny_llama()
        torch.save({"config": hf.config.to_dict(),
                    "weights": {k: v.detach().clone() for k, v in hf.state_dict().items()}}, path)
    return functools.partial(_load, str(path), engine_kw)


def hf_tiny_hybrid() -> Any:
    """A tiny random Qwen3.5 (three Gated DeltaNet layers, one gated attention layer)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=24,
        linear_value_head_dim=20, max_position_embeddings=512, eos_token_id=256, tie_word_embeddings=False)
    model = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF initialises the (1 + w) norms at zero: move them off it
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.normal_(0, 0.3)
    return model


def tiny_hybrid_factory(directory: Path, **engine_kw: Any) -> Callable[[], LLMEngine]:
    """A picklable factory for hf_tiny_hybrid(), saved under `directory`."""
    path = directory / "tiny-hybrid.pt"
    if not path.exists():
        hf = hf_tiny_hybrid()
        torch.save({"config": {**hf.config.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]},
                    "weights": {k: v.detach().clone() for k, v in hf.state_dict().items()}}, path)
    return functools.partial(_load, str(path), engine_kw)
