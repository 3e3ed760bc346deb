"""HF `tokenizers` backend with the model's chat template (rendered like transformers does)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja's built-in filter, no HTML escaping: templates emit raw JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class HFTokenizer:
    """Implements `prelude.tokenizer.base.Tokenizer` over a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        tokenizer: RustTokenizer | Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
        token_to_id: Callable[[str], int | None] | None = None,
    ) -> None:
        """`tokenizer`: loaded, or its tokenizer.json, read at first use. fasttoken's delegate
        (chat template, BOS/EOS) takes the path and its `token_to_id`, and so never reads the
        file unless a panic in fasttoken's core falls back to it, and no start pays for it."""
        self._path = tokenizer if isinstance(tokenizer, Path) else None
        self._tok = None if isinstance(tokenizer, Path) else self._serving(tokenizer)
        self._tok_lock = threading.Lock()
        lookup = token_to_id if token_to_id is not None else (lambda token: self.backend.token_to_id(token))
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bos_id = lookup(bos_token) if bos_token else None
        eos = set(extra_eos_ids)
        eos_id = lookup(eos_token) if eos_token else None
        if eos_id is not None:
            eos.add(eos_id)
        self._eos_ids = frozenset(eos)
        self._chat_template = chat_template
        self._compiled = _compile_template(chat_template) if chat_template else None

    @staticmethod
    def _serving(tokenizer: RustTokenizer) -> RustTokenizer:
        # tokenizer.json may carry padding/truncation settings (BERT exports do);
        # serving encodes one sequence at a time, exactly as given.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        return tokenizer

    @classmethod
    def from_dir(cls, path: Path, token_to_id: Callable[[str], int | None] | None = None) -> "HFTokenizer":
        """The model directory's tokenizer; with `token_to_id`, tokenizer.json is read at
        first use (see __init__)."""
        path = Path(path)
        tok: RustTokenizer | Path = path / "tokenizer.json"
        if token_to_id is None:
            tok = RustTokenizer.from_file(str(tok))
        cfg = _read_json(path / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if template is None and (path / "chat_template.json").exists():
            template = _read_json(path / "chat_template.json").get("chat_template")
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(path / name).get("eos_token_id")
            extra.extend([eos] if isinstance(eos, int) else [e for e in eos or [] if isinstance(e, int)])
        return cls(
            tok,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            extra_eos_ids=extra,
            chat_template=template,
            token_to_id=token_to_id,
        )

    @property
    def backend(self) -> RustTokenizer:
        if self._tok is None:
            with self._tok_lock:
                if self._tok is None:
                    self._tok = self._serving(RustTokenizer.from_file(str(self._path)))
        return self._tok

    @functools.cached_property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """Token ids and token-type ids of a sentence pair (cross-encoders)."""
        enc = self.backend.encode(first, second, add_special_tokens=True)
        return enc.ids, enc.type_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self._compiled is None:
            raise ValueError("this model has no chat template; use /v1/completions with a raw prompt")
        context = {"bos_token": self._bos_token or "", "eos_token": self._eos_token or "", **kwargs}
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}
