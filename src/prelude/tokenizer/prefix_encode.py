"""Prefix-aware encoding on the validation path.

Requests often repeat a long head: a chat's system prompt rendered by the template, a
/v1/score query sent with batch after batch of items. A tokenizer that memoizes prefix
encodings (fasttoken's `encode_with_prefix`) encodes only the new tail when the joint is
safe (it says so itself and encodes the whole text otherwise); any other tokenizer
encodes the whole text. The ids are those of a full encode either way.
"""

from __future__ import annotations

from typing import Any, Sequence

SYSTEM_ROLES = ("system", "developer")


def encode_joined(tokenizer: Any, prefix: str, suffix: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(prefix + suffix)`, reusing a memoized encoding of `prefix` where
    the tokenizer offers one."""
    with_prefix = getattr(tokenizer, "encode_with_prefix", None)
    if with_prefix is None:
        return tokenizer.encode(prefix + suffix, add_special_tokens=add_special_tokens)
    return with_prefix(prefix, suffix, add_special_tokens)


def system_turn_end(text: str, messages: Sequence[dict[str, Any]]) -> int:
    """Where the leading system turns end in a rendered chat prompt: just past the first
    newline after the last leading system message's text (templates close a turn with a
    newline); 0 when there is no such turn or nothing follows it. Any cut is correct (the
    tokenizer checks the joint); this one repeats across requests sharing a system prompt."""
    lead = 0
    while lead < len(messages) - 1 and messages[lead].get("role") in SYSTEM_ROLES:
        lead += 1
    if lead == 0:
        return 0
    end = 0
    for m in messages[:lead]:
        content = m.get("content")
        if not isinstance(content, str) or not content:
            return 0
        at = text.find(content, end)
        if at < 0:
            return 0
        end = at + len(content)
    newline = text.find("\n", end)
    return newline + 1 if 0 <= newline < len(text) - 1 else 0


def encode_chat_prompt(tokenizer: Any, text: str, messages: Sequence[dict[str, Any]]) -> list[int]:
    """A rendered chat prompt's ids (no special tokens added: the template holds them),
    the system turns through the tokenizer's prefix memo."""
    cut = system_turn_end(text, messages)
    if cut == 0:
        return tokenizer.encode(text, add_special_tokens=False)
    return encode_joined(tokenizer, text[:cut], text[cut:], add_special_tokens=False)
