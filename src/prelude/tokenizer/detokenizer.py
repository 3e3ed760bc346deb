"""Incremental detokenization for streams, correct across multi-byte characters.

Works with any tokenizer that can decode a list of ids: decode a short window ending
at the new token and emit only what the window adds, holding back while the tail is an
incomplete UTF-8 sequence (decoded as U+FFFD).
"""

from __future__ import annotations

from prelude.tokenizer.base import Tokenizer


class IncrementalDetokenizer:
    # A window of a few tokens before the new ones lets the tokenizer apply context
    # rules (leading spaces, byte fallback merges) identically to a full decode.
    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._CONTEXT :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._prefix_offset > 64:  # ids before the window are never read again
                del self._ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return new
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the stream (e.g. a dangling partial character)."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
