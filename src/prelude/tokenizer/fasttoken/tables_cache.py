"""fasttoken's vocabulary tables kept on disk beside its equality verdict, so a later start
skips reading tokenizer.json's JSON, checking its merges and computing each entry's bytes.

For a vocabulary of tens of thousands of entries that work is a noticeable part of every
start, with the GIL held while the server's modules import beside it; the tables read from
this file (marshal: plain dicts, lists and bytes) build the FastTokenizer in a fraction of
that. The file is named by the tokenizer.json's content
hash and the versions its verdict is keyed on (equality.py), so a changed tokenizer or
fasttoken gets new tables; one that cannot be read is built again and rewritten.
"""

from __future__ import annotations

import logging
import marshal
import os
from dataclasses import dataclass
from pathlib import Path

from prelude.tokenizer.fasttoken.spec import AddedToken, TokenizerSpec

logger = logging.getLogger("prelude.fasttoken")

_FORMAT = 1  # bumped when the file's layout changes


@dataclass(frozen=True)
class VocabTables:
    spec: TokenizerSpec  # from the cache: merges empty (checked when the tables were built)
    vocab_bytes: list[bytes]  # token id -> its bytes, for vocabulary entries (b"" elsewhere)


def load_tables(path: Path) -> VocabTables | None:
    """The tables stored at `path`, or None when there are none or they cannot be read."""
    try:
        data = marshal.loads(Path(path).read_bytes())
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError("another layout")
        spec = TokenizerSpec(
            vocab=data["vocab"], merges=[], added=tuple(AddedToken(*t) for t in data["added"]),
            pattern=data["pattern"], nfc=data["nfc"], prefix_ids=tuple(data["prefix_ids"]),
            suffix_ids=tuple(data["suffix_ids"]), unk_token=data["unk_token"], pre_tokenizer=data["pre_tokenizer"],
        )
        return VocabTables(spec, data["vocab_bytes"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError, TypeError, KeyError) as exc:
        logger.warning("ignoring the unreadable fasttoken tables %s (%s); building them again", path, exc)
        return None


def save_tables(path: Path, tables: VocabTables) -> None:
    """Write atomically (a reader never sees half a file); a failure only costs later starts."""
    spec = tables.spec  # its merges are not kept: they were checked when the tables were built
    data = {
        "format": _FORMAT, "vocab": spec.vocab, "added": [(t.id, t.content, t.special) for t in spec.added],
        "pattern": spec.pattern, "nfc": spec.nfc, "prefix_ids": list(spec.prefix_ids),
        "suffix_ids": list(spec.suffix_ids), "unk_token": spec.unk_token, "pre_tokenizer": spec.pre_tokenizer,
        "vocab_bytes": tables.vocab_bytes,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(marshal.dumps(data))
        tmp.replace(path)
    except (OSError, ValueError) as exc:  # ValueError: something marshal cannot write
        logger.warning("could not cache the fasttoken tables in %s (%s)", path, exc)
