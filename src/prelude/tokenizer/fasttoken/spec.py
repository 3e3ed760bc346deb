"""Read a `tokenizer.json` into the inference-only subset fasttoken supports.

Supported: byte-level BPE (GPT-2 / SmolLM2, Llama 3, Qwen2 / Qwen3 families) with an
optional NFC normalizer, one of the known pre-tokenizer shapes, ByteLevel or
TemplateProcessing post-processors, a ByteLevel decoder, and added tokens without
strip/single-word rules. Anything else raises `Unsupported` with the reason, and the
caller falls back to HF `tokenizers`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# GPT-2's split pattern, which HF's ByteLevel(use_regex=True) applies.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same after a Digits(individual_digits=True) pre-split (SmolLM2, StarCoder): a digit is
# always its own piece, and a whitespace run before a digit ends a piece like end of text.
GPT2_DIGITS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""


class Unsupported(ValueError):
    """The tokenizer.json uses something outside fasttoken's inference subset."""


@dataclass(frozen=True)
class AddedToken:
    id: int
    content: str
    special: bool


@dataclass(frozen=True)
class TokenizerSpec:
    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    added: tuple[AddedToken, ...]
    pattern: str
    nfc: bool
    prefix_ids: tuple[int, ...]  # post-processor tokens before a single sequence
    suffix_ids: tuple[int, ...]
    unk_token: str | None  # what HF emits for a byte with no vocabulary entry (None: drops it)
    pre_tokenizer: dict[str, Any]  # the raw JSON, to rebuild HF's own splitter when needed


def _pattern(pre: dict[str, Any] | None) -> str:
    if pre is None:
        raise Unsupported("no pre-tokenizer")
    kind = pre.get("type")
    if kind == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            raise Unsupported("ByteLevel pre-tokenizer with add_prefix_space or without its regex")
        return GPT2_PATTERN
    if kind != "Sequence":
        raise Unsupported(f"pre-tokenizer {kind}")
    steps = pre.get("pretokenizers", [])
    kinds = [s.get("type") for s in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        if steps[1].get("add_prefix_space") or not steps[1].get("use_regex", True):
            raise Unsupported("ByteLevel with add_prefix_space after Digits")
        return GPT2_DIGITS_PATTERN
    if kinds == ["Split", "ByteLevel"]:
        split, byte_level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
            raise Unsupported("Split pre-tokenizer other than an isolated regex")
        if byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
            raise Unsupported("ByteLevel after Split must not split again")
        return str(regex)
    raise Unsupported(f"pre-tokenizer sequence {kinds}")


def _post(post: dict[str, Any] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if post is None or post.get("type") == "ByteLevel":
        return (), ()
    if post.get("type") == "Sequence":
        prefix: tuple[int, ...] = ()
        suffix: tuple[int, ...] = ()
        for p in post.get("processors", []):
            a, b = _post(p)
            prefix, suffix = prefix + a, suffix + b
        return prefix, suffix
    if post.get("type") != "TemplateProcessing":
        raise Unsupported(f"post-processor {post.get('type')}")
    specials = {k: v["ids"] for k, v in (post.get("special_tokens") or {}).items()}
    before: list[int] = []
    after: list[int] = []
    seen_sequence = False
    for piece in post.get("single", []):
        if "Sequence" in piece:
            if piece["Sequence"].get("id") != "A" or seen_sequence:
                raise Unsupported("template with an unusual sequence part")
            seen_sequence = True
        elif "SpecialToken" in piece:
            ids = specials.get(piece["SpecialToken"]["id"])
            if ids is None:
                raise Unsupported("template names an unknown special token")
            (after if seen_sequence else before).extend(ids)
    return tuple(before), tuple(after)


def read_spec(path: Path) -> TokenizerSpec:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise Unsupported(f"model type {model.get('type')} (fasttoken serves byte-level BPE)")
    if model.get("byte_fallback") or model.get("dropout") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        raise Unsupported("BPE with byte fallback, dropout or subword affixes")
    decoder = data.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise Unsupported(f"decoder {decoder.get('type')}")
    normalizer = data.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise Unsupported(f"normalizer {normalizer.get('type')}")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    added = []
    for t in data.get("added_tokens", []):
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            raise Unsupported(f"added token {t['content']!r} with strip/single-word rules")
        if t.get("normalized") and normalizer is not None:  # matched on normalized text: not modelled
            raise Unsupported(f"normalized added token {t['content']!r}")
        added.append(AddedToken(int(t["id"]), str(t["content"]), bool(t.get("special"))))
    prefix, suffix = _post(data.get("post_processor"))
    return TokenizerSpec(
        vocab=dict(model["vocab"]),
        merges=merges,  # type: ignore[arg-type]
        added=tuple(added),
        pattern=_pattern(data.get("pre_tokenizer")),
        nfc=normalizer is not None,
        prefix_ids=prefix,
        suffix_ids=suffix,
        unk_token=model.get("unk_token"),
        pre_tokenizer=data["pre_tokenizer"],
    )
