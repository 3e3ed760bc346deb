"""Pick the tokenizer backend for a model directory: fasttoken when it proves itself
equal to HF `tokenizers` (PRELUDE_TOKENIZER=hf forces HF)."""

from __future__ import annotations

import os
from pathlib import Path

from prelude.tokenizer.base import Tokenizer
from prelude.tokenizer.hf import HFTokenizer


def load_tokenizer(model_dir: Path) -> Tokenizer:
    if os.environ.get("PRELUDE_TOKENIZER", "fasttoken") == "hf":
        return HFTokenizer.from_dir(model_dir)
    from prelude.tokenizer.fasttoken.equality import wrap_if_equal

    return wrap_if_equal(Path(model_dir) / "tokenizer.json",
                         lambda token_to_id: HFTokenizer.from_dir(model_dir, token_to_id=token_to_id))
