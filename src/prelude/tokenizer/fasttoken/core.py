"""fasttoken: load once, immutable tables (locks only around the prefix memo and the fallback path).

The BPE core is tiktoken's rank-based merge (Rust, releases the GIL). Ranks are the
HF token ids, which is exact when the merge list creates tokens in id order (checked
at load, and the equality check covers the rest). Decoding reads a contiguous
id -> bytes table.
"""

from __future__ import annotations

import codecs
import logging
import os
import re
import threading
import unicodedata
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from pathlib import Path
from typing import Any, Sequence

import tiktoken
from tokenizers import normalizers

from prelude.tokenizer.fasttoken.byte_gaps import ByteGapEncoder, missing_single_bytes
from prelude.tokenizer.fasttoken.spec import Unsupported, read_spec
from prelude.tokenizer.fasttoken.tables_cache import VocabTables, load_tables, save_tables

logger = logging.getLogger("prelude.fasttoken")

# Bumped whenever encode/decode behaviour changes: cached equality verdicts are keyed on it.
FASTTOKEN_VERSION = "4"

# Input classes logged per tokenizer before it stops logging new ones.
_MAX_LOGGED_CLASSES = 64


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes -> printable-unicode map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class _TokenBytes:
    """A vocabulary entry's bytes: a byte-level token's characters each stand for one byte;
    any other entry (an added token's plain text) is its UTF-8. Whole strings at C speed
    (a subset test, `str.translate` to Latin-1): a 49k vocabulary in 0.07 s, not 0.14."""

    def __init__(self, byte_decoder: dict[str, int]) -> None:
        self._alphabet = frozenset(byte_decoder)
        self._to_latin1 = str.maketrans({ch: chr(b) for ch, b in byte_decoder.items()})

    def __call__(self, token: str) -> bytes:
        if self._alphabet.issuperset(token):
            return token.translate(self._to_latin1).encode("latin-1")
        return token.encode("utf-8")


def _vocab_tables(path: Path, token_bytes: _TokenBytes) -> VocabTables:
    """tokenizer.json's spec and each vocabulary entry's bytes, computed once (start-up
    time): the id -> bytes table serves decoding, and the BPE ranks are its inverse
    without the added tokens."""
    spec = read_spec(path)
    merged_ids = [spec.vocab.get(a + b) for a, b in spec.merges]
    if any(i is None for i in merged_ids) or any(x >= y for x, y in zip(merged_ids, merged_ids[1:])):  # type: ignore[operator]
        raise Unsupported("merges do not create tokens in id order (ranks would differ from HF)")
    vocab_bytes: list[bytes] = [b""] * (max(spec.vocab.values(), default=-1) + 1)
    for tok, i in spec.vocab.items():
        vocab_bytes[i] = token_bytes(tok)
    return VocabTables(spec, vocab_bytes)


class FastTokenizer:
    """Inference-only tokenizer for byte-level BPE `tokenizer.json` files.

    Satisfies `prelude.tokenizer.base.Tokenizer`; chat templates, BOS/EOS come from a
    delegate (the model's HFTokenizer), as they are model metadata, not tokenization.
    """

    def __init__(self, path: Path, delegate: Any | None = None, prefix_cache_size: int = 64,
                 tables_file: Path | None = None) -> None:
        """`tables_file`: where the vocabulary tables are kept between starts (tables_cache.py);
        None reads tokenizer.json every time."""
        self._path = Path(path)
        self._delegate = delegate
        decoder = _byte_decoder()
        token_bytes = _TokenBytes(decoder)
        tables = load_tables(tables_file) if tables_file is not None else None
        if tables is None:
            tables = _vocab_tables(self._path, token_bytes)
            if tables_file is not None:
                save_tables(tables_file, tables)
        spec = tables.spec
        self._spec = spec
        # Added tokens are matched as whole strings before BPE (as HF does), so they leave
        # the merge table even when the vocabulary also lists them.
        specials = {t.content: t.id for t in spec.added}
        added_ids = set(specials.values())
        size = max([len(tables.vocab_bytes), *(t.id + 1 for t in spec.added)])
        table = tables.vocab_bytes + [b""] * (size - len(tables.vocab_bytes))
        ranks = {table[i]: i for i in spec.vocab.values() if i not in added_ids}
        if len(ranks) != len(spec.vocab) - len(added_ids & set(spec.vocab.values())):
            raise Unsupported("two vocabulary entries share the same bytes")
        self._enc = tiktoken.Encoding(
            name=f"fasttoken-{Path(path).stem}", pat_str=spec.pattern, mergeable_ranks=ranks, special_tokens=specials
        )
        missing = missing_single_bytes(ranks)
        if missing and spec.unk_token is not None:
            raise Unsupported("bytes without a token of their own and an unk token (HF would emit unk)")
        self._gaps = ByteGapEncoder(missing, spec.pre_tokenizer, self._enc._core_bpe, decoder) if missing else None
        for t in spec.added:
            table[t.id] = token_bytes(t.content)
        self._bytes: tuple[bytes, ...] = tuple(table)
        self._special_ids = frozenset(t.id for t in spec.added if t.special)
        # The same table with special tokens empty: skip_special_tokens costs nothing.
        self._bytes_skip: tuple[bytes, ...] = tuple(b"" if i in self._special_ids else b for i, b in enumerate(table))
        self._texts: tuple[str, ...] = tuple(b.decode("utf-8", errors="replace") for b in table)
        self._nfc = normalizers.NFC() if spec.nfc else None
        self._prefix_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._prefix_cache_size = prefix_cache_size
        self._prefix_lock = threading.Lock()
        # Most texts hold no added token: one C-level regex search decides, and the
        # ordinary path skips passing the special-token set into Rust on every call.
        self._core = self._enc._core_bpe
        self._added_ids = dict(specials)
        self._newline_splits = tuple((t[:k], t[k:]) for t in specials for k in range(1, len(t)) if t[k - 1] == "\n")
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
            if specials else None
        # Threads start on first use; an unused pool costs nothing.
        self._workers = os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="fasttoken")
        # The safety net: a panic in the Rust core is answered by HF instead (counted, and
        # logged once per input class). The lock guards only that rare path.
        self._fallbacks = 0
        self._logged_classes: set[tuple[str, ...]] = set()
        self._fallback_lock = threading.Lock()
        self._hf: Any | None = None

    # --- the Tokenizer protocol --------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    def token_to_id(self, token: str) -> int | None:
        """A vocabulary entry's or an added token's id (HF's `token_to_id`), None if neither."""
        added = self._added_ids.get(token)
        return added if added is not None else self._spec.vocab.get(token)

    def delegate_to(self, delegate: Any) -> None:
        """Set the delegate after construction: one built from this tokenizer's `token_to_id`
        (loading.py) cannot exist before it. Before the tokenizer is shared."""
        self._delegate = delegate

    @property
    def bos_token_id(self) -> int | None:
        return self._delegate.bos_token_id if self._delegate is not None else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._delegate.eos_token_ids if self._delegate is not None else frozenset()

    @property
    def chat_template(self) -> str | None:
        return self._delegate.chat_template if self._delegate is not None else None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        if self._delegate is None:
            raise ValueError("this tokenizer has no chat template")
        return self._delegate.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kw)

    def _normalize(self, text: str) -> str:
        # Python's quick check says whether anything could change (fast, in C); the change
        # itself is HF's: its Unicode tables are older than Python's, and a mark newer than
        # them (U+0898, Unicode 14) is not reordered there, so Python's NFC would differ.
        if self._nfc is not None and not unicodedata.is_normalized("NFC", text):
            return self._nfc.normalize_str(text)
        return text

    def _wrap(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and (self._spec.prefix_ids or self._spec.suffix_ids):
            return [*self._spec.prefix_ids, *ids, *self._spec.suffix_ids]
        return ids

    def _ordinary(self, text: str) -> list[int]:
        """BPE of text holding no added token, normalized first (as HF normalizes each
        stretch between added tokens, not the whole text: '>' + U+0338 would compose)."""
        text = self._normalize(text)
        gaps = self._gaps
        if gaps is not None and gaps.affects(text):
            return gaps.encode(text)
        return self._core.encode_ordinary(text)

    def _encode_raw(self, text: str) -> list[int]:
        """Added tokens are cut out of the raw text first (longest match at each position,
        as HF does), the text between them goes through BPE; no per-call set crosses into Rust."""
        if self._special_re is None:
            return self._ordinary(text)
        out: list[int] | None = None
        pos = 0
        for m in self._special_re.finditer(text):
            if out is None:
                out = []
            if m.start() > pos:
                out.extend(self._ordinary(text[pos : m.start()]))
            out.append(self._added_ids[m.group()])
            pos = m.end()
        if out is None:
            return self._ordinary(text)
        if pos < len(text):
            out.extend(self._ordinary(text[pos:]))
        return out

    # --- the safety net ----------------------------------------------------------------

    @property
    def fallback_count(self) -> int:
        """Encodes answered by HF because the Rust core panicked (for /metrics)."""
        return self._fallbacks

    def _hf_backend(self) -> Any:
        if self._hf is None:
            backend = getattr(self._delegate, "backend", None)
            self._hf = backend if backend is not None else _load_hf(self._path)
        return self._hf

    def _fall_back(self, text: str, add_special_tokens: bool, exc: BaseException) -> list[int]:
        # The class, not the text: which Unicode categories it holds (no user data in logs).
        kind = tuple(sorted({unicodedata.category(ch) for ch in text}))
        with self._fallback_lock:
            self._fallbacks += 1
            first = kind not in self._logged_classes and len(self._logged_classes) < _MAX_LOGGED_CLASSES
            if first:
                self._logged_classes.add(kind)
        if first:
            logger.warning("fasttoken core panicked (%s) on a text of %d characters in categories %s; "
                           "HF tokenizers answers such calls", exc, len(text), ",".join(kind))
        return self._hf_backend().encode(text, add_special_tokens=add_special_tokens).ids

    def _guarded(self, text: str, add_special_tokens: bool, encode: Any) -> list[int]:
        """`encode()`, with a Rust panic (a BaseException, not an Exception) answered by HF."""
        try:
            return encode()
        except Exception:
            raise
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            return self._fall_back(text, add_special_tokens, exc)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._guarded(text, add_special_tokens,
                             lambda: self._wrap(self._encode_raw(text), add_special_tokens))

    def _encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._guarded(t, False, lambda t=t: self._encode_raw(t)) for t in texts]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Parallel encode over a persistent pool: the Rust core releases the GIL. Small
        batches stay on the caller's thread, where a hand-off would cost more than it saves."""
        workers = self._workers
        if len(texts) < 16 or workers == 1:
            out = self._encode_many(texts)
        else:
            step = (len(texts) + workers - 1) // workers
            chunks = [texts[i : i + step] for i in range(0, len(texts), step)]
            out = [ids for part in self._pool.map(self._encode_many, chunks) for ids in part]
        return [self._wrap(ids, add_special_tokens) for ids in out]

    def joint_is_safe(self, prefix: str, suffix: str) -> bool:
        """Whether encoding `prefix` and `suffix` apart gives the ids of `prefix + suffix`.

        True when the prefix ends in one newline after a non-space character and the suffix
        starts with a character that is neither whitespace nor a combining mark, and no
        added token straddles the joint. Then the newline is a pre-token of its own in both
        encodings under the byte-level patterns fasttoken accepts (GPT-2's and Llama 3 /
        Qwen 2's: no alternative crosses a newline into non-space text, and none looks
        behind), and NFC cannot compose or reorder across a newline. An empty suffix has
        no joint. Checked against full encodes by a property test (adversarial joints too).
        """
        if not suffix:
            return True
        if len(prefix) < 2 or prefix[-1] != "\n" or prefix[-2].isspace():
            return False
        first = suffix[0]
        if first.isspace() or unicodedata.category(first).startswith("M"):
            return False
        # An added token straddling the joint would have to hold a newline where the prefix
        # ends: the (usually empty) list of such splits is made at load.
        return not any(prefix.endswith(head) and suffix.startswith(tail) for head, tail in self._newline_splits)

    def encode_with_prefix(self, prefix: str, suffix: str, add_special_tokens: bool = True) -> list[int]:
        """Encode prefix + suffix reusing a memoized encoding of `prefix` (a chat template's
        system turn, a rubric, a scoring query) where the joint is safe (`joint_is_safe`);
        otherwise the whole text is encoded. Equal to `encode(prefix + suffix)` either way."""
        if not self.joint_is_safe(prefix, suffix):
            return self.encode(prefix + suffix, add_special_tokens)
        return self._guarded(prefix + suffix, add_special_tokens,
                             lambda: self._encode_with_prefix(prefix, suffix, add_special_tokens))

    def _encode_with_prefix(self, prefix: str, suffix: str, add_special_tokens: bool) -> list[int]:
        with self._prefix_lock:  # the server encodes on several threads
            head = self._prefix_cache.get(prefix)
            if head is not None:
                self._prefix_cache.move_to_end(prefix)
        if head is None:
            head = tuple(self._encode_raw(prefix))
            with self._prefix_lock:
                self._prefix_cache[prefix] = head
                if len(self._prefix_cache) > self._prefix_cache_size:
                    self._prefix_cache.popitem(last=False)
        return self._wrap([*head, *self._encode_raw(suffix)] if suffix else list(head), add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids past the table (a padded model head) decode to nothing, as in HF."""
        table = self._bytes_skip if skip_special_tokens else self._bytes
        try:
            if len(ids) < 2:  # itemgetter returns a bare item for one index
                data = table[ids[0]] if ids else b""
            else:
                data = b"".join(itemgetter(*ids)(table))  # one C call gathers every token's bytes
        except IndexError:
            size = len(table)
            data = b"".join(table[i] for i in ids if i < size)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self._texts[token_id] if token_id < len(self._texts) else ""

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if token_id < len(self._bytes) else b""

    def new_detokenizer(self, skip_special_tokens: bool = True) -> "ByteStreamDetokenizer":
        return ByteStreamDetokenizer(self._bytes, self._special_ids if skip_special_tokens else frozenset())


class ByteStreamDetokenizer:
    """Streaming decode from the id -> bytes table: emits only complete UTF-8 text, so a
    character split across tokens appears once, whole."""

    def __init__(self, table: tuple[bytes, ...], skip: frozenset[int]) -> None:
        self._table = table
        self._skip = skip
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skip or token_id >= len(self._table):  # past the table: nothing, as in HF
            return ""
        return self._decoder.decode(self._table[token_id])

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def _load_hf(path: Path) -> Any:
    from tokenizers import Tokenizer as RustTokenizer

    return RustTokenizer.from_file(str(path))
