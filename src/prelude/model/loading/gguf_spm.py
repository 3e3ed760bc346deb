"""A GGUF's sentencepiece vocabulary (`tokenizer.ggml.model` = "llama": Gemma, Llama 2) as a
HF `tokenizers` BPE with byte fallback.

llama.cpp's sentencepiece tokenizer merges adjacent pieces whose concatenation is in the
vocabulary, best-ranked first; a BPE over merges listed in that rank order computes the
same pieces. The file lists no merges, so they are rebuilt: every split of a token into two
tokens is a merge ranked as the token. The rank is the token's score, except for Gemma,
whose scores do not follow its merge order but whose file order does; Gemma files also
spell a token of spaces with real spaces where its pieces use U+2581.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from prelude.model.loading.gguf_file import GgufFile

_SPACE = "\u2581"
# token types (llama.cpp's llama_token_type)
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6


def _merges(tokens: list[str], ranks: list[float], mergeable: list[bool]) -> list[tuple[str, str]]:
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for i, token in enumerate(tokens):
        if not mergeable[i]:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None and mergeable[li] and mergeable[ri]:
                found.append((-ranks[i], li, ri, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def spm_tokenizer(reader: GgufFile) -> tuple[Tokenizer, dict[str, Any]]:
    """The HF tokenizer and a tokenizer_config dict of a sentencepiece GGUF."""
    arch = str(reader.field("general.architecture"))
    tokens: list[str] = list(reader.field("tokenizer.ggml.tokens"))
    types: list[int] = list(reader.field("tokenizer.ggml.token_type", [1] * len(tokens)))
    gemma = arch.startswith("gemma")
    if gemma:
        tokens = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        ranks = [-float(i) for i in range(len(tokens))]
    else:
        ranks = [float(s) for s in reader.field("tokenizer.ggml.scores", [0.0] * len(tokens))]
    mergeable = [ty not in (_CONTROL, _BYTE, _UNKNOWN) for ty in types]
    name = lambda key: tokens[int(reader.field(key))] if reader.field(key) is not None else None  # noqa: E731
    unk = name("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(tokens, ranks, mergeable), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    prefix = bool(reader.field("tokenizer.ggml.add_space_prefix", not gemma))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    tok.add_tokens([AddedToken(t, special=ty == _CONTROL, normalized=False)
                    for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)])
    bos, eos = name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
    add_bos = bool(reader.field("tokenizer.ggml.add_bos_token", True))
    add_eos = bool(reader.field("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is not None) or (add_eos and eos is not None):
        head = f"{bos} " if add_bos and bos is not None else ""
        tail = f" {eos}" if add_eos and eos is not None else ""
        specials = {t for t in (bos if add_bos else None, eos if add_eos else None) if t is not None}
        tok.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B{tail}",
            special_tokens=[(t, vocab[t]) for t in sorted(specials)])
    config = {
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos, "add_eos_token": add_eos, "chat_template": reader.field("tokenizer.chat_template"),
        "model_max_length": int(reader.field(f"{arch}.context_length", 2048)),
    }
    return tok, config
