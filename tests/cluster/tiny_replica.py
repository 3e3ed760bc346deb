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

from tests.engine.tiny import ByteTokenizer, hf_tiny_hybrid, hf_tiny_llama


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


def tiny_hybrid_factory(directory: Path, **engine_kw: Any) -> Callable[[], LLMEngine]:
    """A picklable factory for hf_tiny_hybrid(), saved under `directory`."""
    path = directory / "tiny-hybrid.pt"
    if not path.exists():
        hf = hf_tiny_hybrid()
        torch.save({"config": {**hf.config.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]},
                    "weights": {k: v.detach().clone() for k, v in hf.state_dict().items()}}, path)
    return functools.partial(_load, str(path), engine_kw)
