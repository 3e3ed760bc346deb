"""load_tokenizer: fasttoken's HF delegate takes its BOS/EOS ids from fasttoken's vocabulary
and reads tokenizer.json only when something asks HF itself to tokenize."""

from __future__ import annotations

from pathlib import Path

import pytest

from prelude.model.loading.files import load_model_files
from prelude.tokenizer import hf as hf_module
from prelude.tokenizer.fasttoken import FastTokenizer
from prelude.tokenizer.hf import HFTokenizer
from prelude.tokenizer.loading import load_tokenizer


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return load_model_files(None).model_dir


@pytest.fixture
def rust_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths HF's Rust tokenizer is read from through prelude.tokenizer.hf, in order."""
    loads: list[str] = []
    real = hf_module.RustTokenizer

    class Counting:
        @staticmethod
        def from_file(path: str) -> object:
            loads.append(path)
            return real.from_file(path)

    monkeypatch.setattr(hf_module, "RustTokenizer", Counting)
    return loads


def test_fasttokens_delegate_answers_ids_and_templates_without_reading_hf(model_dir: Path,
                                                                         rust_loads: list[str]) -> None:
    plain = HFTokenizer(hf_module.RustTokenizer.from_file(str(model_dir / "tokenizer.json")))  # ids only
    rust_loads.clear()
    tok = load_tokenizer(model_dir)
    assert isinstance(tok, FastTokenizer)
    reference = HFTokenizer.from_dir(model_dir)
    assert len(rust_loads) == 1  # the reference's, none for fasttoken's delegate
    assert tok.bos_token_id == reference.bos_token_id and tok.eos_token_ids == reference.eos_token_ids
    assert tok.eos_token_ids  # the default model has an EOS: the lookup found it
    messages = [{"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(messages) == reference.apply_chat_template(messages)
    for token in ("<|im_end|>", "Ġthe", "hello", "not a token at all"):
        assert tok.token_to_id(token) == reference.backend.token_to_id(token), token
    assert len(rust_loads) == 1
    # Asked to tokenize, the delegate reads its tokenizer.json once, then answers as HF does.
    delegate = tok._delegate
    assert delegate.encode("Hello world") == reference.encode("Hello world") == plain.encode("Hello world")
    assert delegate.vocab_size == reference.vocab_size
    assert len(rust_loads) == 2 and rust_loads[1] == str(model_dir / "tokenizer.json")


def test_plain_hf_reads_its_tokenizer_at_once(model_dir: Path, rust_loads: list[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRELUDE_TOKENIZER", "hf")
    tok = load_tokenizer(model_dir)
    assert isinstance(tok, HFTokenizer) and len(rust_loads) == 1
    assert tok.eos_token_ids and tok.decode(tok.encode("Hello world")) == "Hello world"
