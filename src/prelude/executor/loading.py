"""Model files -> a runner on its device plus the tokenizer: the engine's one entry to
loading, so that it never touches model classes or checkpoint formats."""

from __future__ import annotations

from dataclasses import dataclass

from prelude.config import EngineConfig
from prelude.executor.runner import ModelRunner
from prelude.model.loader import load_model_files
from prelude.tokenizer.base import Tokenizer


@dataclass(frozen=True)
class LoadedRunner:
    runner: ModelRunner
    tokenizer: Tokenizer
    name: str


def load_runner(config: EngineConfig) -> LoadedRunner:
    loaded = load_model_files(config.model)
    max_pos = getattr(loaded.config, "max_position_embeddings", None)
    if config.scheduler.max_model_len and max_pos is not None:
        max_pos = max(max_pos, config.scheduler.max_model_len)
    runner = ModelRunner.create(loaded.config, loaded.weights, config.executor, config.cache.block_size, max_pos,
                                blocks=loaded.blocks)
    loaded.weights.clear()  # the runner holds the device copy; drop the host one
    loaded.blocks.clear()
    return LoadedRunner(runner, loaded.tokenizer, loaded.name)
