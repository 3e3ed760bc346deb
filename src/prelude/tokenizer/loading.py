"""Pick the tokenizer backend for a model directory."""

from __future__ import annotations

from pathlib import Path

from prelude.tokenizer.base import Tokenizer
from prelude.tokenizer.hf import HFTokenizer


def load_tokenizer(model_dir: Path) -> Tokenizer:
    return HFTokenizer.from_dir(model_dir)
