"""Prelude: a resource-adaptive LLM serving engine."""

from prelude.engine.request import SamplingParams
from prelude.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams"]
