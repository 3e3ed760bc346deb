"""Byte-level vocabularies with bytes that have no token of their own.

SmolLM2's vocabulary has no single-byte token for 21 of the 256 bytes (e.g. 0xF2, the
lead byte of U+80000..U+BFFFF, and a few ASCII control bytes). HF's BPE starts a word
from its bytes' tokens and, without an unk token, silently drops a byte that has none;
the bytes left on either side are then adjacent and may merge. tiktoken's core panics on
such a piece instead ("no entry found for key"). Texts holding one of these bytes take
this path: HF's own pre-tokenizer splits them (so the pieces are HF's by construction),
the unreachable bytes leave each piece, and tiktoken's single-piece BPE merges the rest.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer as RustTokenizer


def missing_single_bytes(ranks: dict[bytes, int]) -> bytes:
    """The bytes that have no single-byte token (HF drops them from every piece)."""
    return bytes(b for b in range(256) if bytes([b]) not in ranks)


def _splitter(pre_tokenizer: dict[str, Any]) -> RustTokenizer:
    """A tokenizer that holds nothing but HF's pre-tokenizer (no vocabulary to load)."""
    return RustTokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }))


class ByteGapEncoder:
    """Encodes, exactly as HF does, the texts whose UTF-8 holds a byte without a token."""

    def __init__(self, missing: bytes, pre_tokenizer: dict[str, Any], core: Any, byte_decoder: dict[str, int]) -> None:
        self._missing = missing
        self._finder = re.compile(b"[" + b"".join(re.escape(bytes([b])) for b in missing) + b"]")
        self._pre = _splitter(pre_tokenizer).pre_tokenizer
        self._core = core
        # HF's pieces come back in the byte-to-printable alphabet: one str.translate and a
        # latin-1 encode turn a piece back into its bytes.
        self._to_latin1 = {ord(ch): b for ch, b in byte_decoder.items()}

    def affects(self, text: str) -> bool:
        # surrogatepass: a lone surrogate is not this path's concern (the core refuses it).
        return self._finder.search(text.encode("utf-8", "surrogatepass")) is not None

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece, _ in self._pre.pre_tokenize_str(text):
            data = piece.translate(self._to_latin1).encode("latin-1").translate(None, self._missing)
            if data:
                out.extend(self._core.encode_single_piece(data))
        return out
