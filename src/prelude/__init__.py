"""Prelude: a resource-adaptive LLM serving engine."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so `prelude serve` reports a bad flag before torch and the engine are imported.
    if name == "LLM":
        from prelude.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from prelude.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'prelude' has no attribute {name!r}")
