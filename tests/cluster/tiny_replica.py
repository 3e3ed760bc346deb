"""Engine factories the replicas run (importable by Ray workers, so picklable by name)."""

from __future__ import annotations

from prelude.engine.engine import LLMEngine

from tests.engine.tiny import hf_tiny_llama, tiny_engine


def tiny_factory() -> LLMEngine:
    """The same weights in every process: hf_tiny_llama seeds torch before building."""
    return tiny_engine(hf_tiny_llama(), num_blocks=256, max_model_len=256)
