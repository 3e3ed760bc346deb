"""The equality check: fasttoken serves a model only after matching HF `tokenizers`.

Checks encode (with and without special tokens), decode (with and without skipping
special tokens, and ids past the table) and streaming decode on a built-in corpus; a
panic in the Rust core counts as a difference even though fasttoken's safety net would
answer it. The verdict is cached per tokenizer.json content hash and the fasttoken,
tiktoken and tokenizers versions (a small JSON file under the cache dir), so later starts
skip the check; an unreadable verdict is re-checked. Any mismatch or unsupported
configuration falls back to HF, loudly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tiktoken
import tokenizers
from tokenizers import Tokenizer as RustTokenizer

from prelude.tokenizer.fasttoken.core import FASTTOKEN_VERSION, FastTokenizer
from prelude.tokenizer.fasttoken.spec import Unsupported

logger = logging.getLogger("prelude.fasttoken")

CHECK_VERSION = "2"  # in the verdict key, still spelled "gate=" so cached verdicts stay valid

CORPUS: tuple[str, ...] = (
    "Hello world", "The quick brown fox jumps over the lazy dog.", " leading space", "trailing space ",
    "double  space", "tabs\tand\nnewlines\n\n\n", "line1\r\nline2\r\n", "   ", "", "a", "!!!???...",
    "It's what they'll do, we've seen I'd HE'S", "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n", "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }",
    "{\"json\": [1, 2, {\"k\": null}], \"pi\": 3.14159}", "https://example.com/path?q=1&r=2#frag",
    "Numbers: 1234567890 3.14159 -42 1e10 007 1,000,000", "x  1", " 123 abc", "a  \n\n 12", "v2.0.1-rc3",
    "中文测试，你好世界。", "日本語のテキストです", "한국어 문장", "Ωμέγα ελληνικά", "мир труд май",
    "naïve café résumé Ångström", "e\u0301 vs \u00e9 (combining accents)", "ÀÉÎÕÜ àéîõü ß",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣", "🤖🤖🤖", "\u00a0nbsp\u2009thin\u3000ideographic\u200bzwsp",
    "mixed 中文 English 123 😀 العربية עברית हिन्दी", "CamelCaseIdentifiersAndsnake_case_ones",
    "ALL CAPS SENTENCE WITH NUMBERS 42", "x" * 200, "ab" * 150, "\n" * 5 + "text" + " " * 7,
    "<|im_start|>user\nhi<|im_end|>", "text with <|endoftext|> inside", "<|im_start|><|im_end|>",
    "<s> </s> <unk> [CLS] [SEP]", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "Zürich's 3rd-place finish (2023) — “quoted” ‘text’ … ellipsis",
    # Classes that once made the core panic: private use and unassigned planes (lead bytes
    # 0xF1/0xF2 have no token in SmolLM2), control bytes without a token, NUL, and a
    # dropped byte between two bytes that merge.
    "\U00081832", "\U0005b3e8ⅈT\ue671眥", "\uf552ٗ밡0\U00081832", "\ue6fa锟볡U\U000780a1",
    "\U00081832\U00081832 \U0004ffff\U000bfffd", "\ue000\uf8ff\U000f0000\U0010fffd \U000e0080\U0003fffe",
    "\u0898\u0316 marks newer than HF's NFC tables", "<|endoftext|>\u0338<|im_end|>\u0301", "\x00 NUL \x04\x06\x13\x14\x16\x1d ctrl", ".\x04. !\x1d! a\x13b", "\u0085\u2028\u2029\x0b\x0c\x1c\x1f",
)


def tokenizer_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:24]


def _versions_key() -> str:
    """A verdict holds only for the code that earned it: this check, fasttoken, tiktoken, tokenizers."""
    versions = f"gate={CHECK_VERSION};fasttoken={FASTTOKEN_VERSION};tiktoken={tiktoken.__version__};" \
               f"tokenizers={tokenizers.__version__}"
    return hashlib.sha256(versions.encode()).hexdigest()[:12]


def _verdict_file(digest: str) -> Path:
    base = os.environ.get("PRELUDE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "prelude"
    )
    return Path(base) / "fasttoken" / f"{digest}-{_versions_key()}.json"


def _read_verdict(path: Path) -> dict[str, Any] | None:
    """The cached verdict, or None when there is none or it cannot be read (then re-check)."""
    try:
        verdict = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the unreadable fasttoken verdict %s (%s); checking again", path, exc)
        return None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("equal"), bool):
        logger.warning("ignoring the malformed fasttoken verdict %s; checking again", path)
        return None
    return verdict


def compare(fast: FastTokenizer, hf: RustTokenizer, corpus: tuple[str, ...] = CORPUS) -> str | None:
    """The first difference between fasttoken and HF on the corpus, or None."""
    past_table = fast.vocab_size + 7  # a padded model head can emit ids the tokenizer lacks
    for text in corpus:
        for special in (True, False):
            want = hf.encode(text, add_special_tokens=special).ids
            panics = fast.fallback_count
            got = fast.encode(text, add_special_tokens=special)
            if fast.fallback_count != panics:
                return f"the fasttoken core panicked on {text[:40]!r}"
            if got != want:
                return f"encode(add_special_tokens={special}) differs on {text[:40]!r}: {got[:12]} vs {want[:12]}"
        ids = hf.encode(text, add_special_tokens=True).ids
        for skip in (True, False):
            if fast.decode(ids, skip) != hf.decode(ids, skip_special_tokens=skip):
                return f"decode(skip_special_tokens={skip}) differs on {text[:40]!r}"
            padded = [*ids, past_table]
            if fast.decode(padded, skip) != hf.decode(padded, skip_special_tokens=skip):
                return f"decode(skip_special_tokens={skip}) of an id past the table differs on {text[:40]!r}"
            stream = fast.new_detokenizer(skip_special_tokens=skip)
            streamed = "".join(stream.push(i) for i in ids) + stream.flush()
            if streamed != hf.decode(ids, skip_special_tokens=skip):
                return f"streaming decode(skip_special_tokens={skip}) differs on {text[:40]!r}"
    return None


def check(tokenizer_json: Path, use_cache: bool = True) -> tuple[FastTokenizer | None, str]:
    """(fasttoken, "equal") when it passes the check, else (None, the reason)."""
    digest = tokenizer_hash(tokenizer_json)
    verdict_path = _verdict_file(digest)
    cached = _read_verdict(verdict_path) if use_cache else None
    if cached is not None:
        if not cached["equal"]:
            return None, f"cached verdict: {cached.get('reason')}"
    try:
        # The tables are kept only where verdicts are (use_cache), named like this one.
        tables_file = verdict_path.with_suffix(".tables") if use_cache else None
        fast = FastTokenizer(tokenizer_json, tables_file=tables_file)
    except (Unsupported, ValueError) as exc:
        return None, f"unsupported: {exc}"
    if cached is not None:
        return fast, "equal (cached verdict)"
    reason = compare(fast, RustTokenizer.from_file(str(tokenizer_json)))
    verdict = {"equal": reason is None, "reason": reason, "corpus": len(CORPUS)}
    if use_cache:
        try:
            verdict_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = verdict_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(verdict))
            tmp.replace(verdict_path)
        except OSError:
            logger.warning("could not cache the fasttoken verdict in %s", verdict_path)
    return (fast, "equal") if reason is None else (None, reason)


def wrap_if_equal(tokenizer_json: Path, hf_tokenizer: Callable[[Callable[[str], int | None] | None], Any]) -> Any:
    """fasttoken when it is proven equal to HF, delegating chat templates and BOS/EOS to
    `hf_tokenizer(fast.token_to_id)` (ids from fasttoken's vocabulary: that delegate need
    not load HF's own); else `hf_tokenizer(None)`, with the reason logged."""
    fast, reason = check(tokenizer_json)
    if fast is None:
        logger.warning("fasttoken falls back to HF tokenizers for %s: %s", tokenizer_json, reason)
        return hf_tokenizer(None)
    fast.delegate_to(hf_tokenizer(fast.token_to_id))
    logger.info("fasttoken serves %s (%s)", tokenizer_json, reason)
    return fast
