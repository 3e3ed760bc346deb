"""Model files -> a runner on its device plus the tokenizer: the engine's one entry to
loading, so that it never touches model classes or checkpoint formats."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Callable

from prelude.config import EngineConfig
from prelude.executor.device import resolve_device
from prelude.executor.runner import ModelRunner
from prelude.kernels.cpu import catalog
from prelude.model.loading.files import load_model_files, weight_files
from prelude.tokenizer.base import Tokenizer


@dataclass(frozen=True)
class LoadedRunner:
    runner: ModelRunner
    tokenizer: Tokenizer
    name: str


def _build_quietly(build: Callable[[], object]) -> None:
    try:
        build()
    except Exception:  # noqa: BLE001 - the kernel's loader reports it when it tries again
        pass


def _build_cpu_kernels(lora: bool) -> list[threading.Thread]:
    """Compile the CPU's C kernels (a fraction of a second each, first start only) on threads while the
    checkpoint loads: the compilers run beside the GGUF conversion instead of after it."""
    builds = [catalog.builder(name) for name in catalog.KERNELS if lora or name != "lora_cpu"]
    threads = [threading.Thread(target=_build_quietly, args=(build,), name=f"build-{build.__module__}", daemon=True)
               for build in builds]
    for t in threads:
        t.start()
    return threads


def load_runner(config: EngineConfig) -> LoadedRunner:
    builds = _build_cpu_kernels(config.lora is not None) if resolve_device(config.executor.device).type == "cpu" else []
    loaded = load_model_files(config.model, json.loads(config.hf_overrides) if config.hf_overrides else None)
    for t in builds:
        t.join()
    max_pos = getattr(loaded.config, "max_position_embeddings", None)
    if config.scheduler.max_model_len and max_pos is not None:
        max_pos = max(max_pos, config.scheduler.max_model_len)
    runner = ModelRunner.create(loaded.config, loaded.weights, config.executor, config.cache.block_size, max_pos,
                                blocks=loaded.blocks, lora=config.lora, checkpoint_files=weight_files(loaded.model_dir),
                                sentence=loaded.sentence, matryoshka=loaded.matryoshka,
                                score_template=loaded.score_template)
    loaded.weights.clear()  # the runner holds the device copy; drop the host one
    loaded.blocks.clear()
    return LoadedRunner(runner, loaded.tokenizer, loaded.name)
