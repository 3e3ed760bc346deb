"""Planning a job before its first request runs.

One lazy pass over the input keeps a few numbers per line (where it is, a hash of its
custom_id, hashes of its prompt's beginning, its length), never the text, so a
multi-GB file does not sit in memory. From them:
- duplicate custom_ids are refused before anything runs;
- lines already answered in a resumed OUTPUT are left out;
- the run order groups lines whose prompts share a beginning (hashes of the first 64,
  256, 1K and 4K characters, coarse to fine; a chat's cuts stop where its last message
  starts, so its items never split its rubric's group, and a last key hashes all of
  what comes before, so rubrics that differ only past 4K characters are told apart), so the radix cache computes each shared rubric once
  and keeps it hot while its group runs, however the file interleaves them; within a
  group the longest go first (similar lengths run side by side; the long ones do not
  trail at the end).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from prelude.entrypoints.batch.lines import LineError, custom_id_of, id_hash, load_object, prefix_text, shared_part

PREFIX_CUTS = (64, 256, 1024, 4096)  # characters; coarse to fine


class DuplicateCustomIds(ValueError):
    """The job is refused: custom_ids must be unique (the output is matched by them)."""


def _text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


_NONE = np.zeros(0, np.int64)


def _int64(values: array) -> np.ndarray:
    return np.frombuffer(values, dtype=np.int64) if len(values) else _NONE


@dataclass
class Plan:
    total_lines: int  # non-blank lines in the input
    already_done: int  # answered in the resumed OUTPUT
    resumed_ids: int  # input custom_ids the resumed OUTPUT answers (the rest of its ids are another input's)
    offsets: np.ndarray  # int64 byte offset of each line to run, in run order
    sizes: np.ndarray  # int64 byte length
    numbers: np.ndarray  # int64 1-based line number
    # Lines with no usable custom_id, not yet answered, in line order: (offset, size, line
    # number) [n, 3] int64, and no message: a flood of them (a 2 MB upload of 1M bad lines)
    # kept ~250 bytes a line as objects; their error is made again from the line (bad_line).
    malformed: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))

    @property
    def to_run(self) -> int:
        return len(self.offsets) + len(self.malformed)

    def lines(self) -> Iterator[tuple[int, int, int]]:
        """(offset, size, line number) of each line to run, in run order."""
        for i in range(len(self.offsets)):
            yield int(self.offsets[i]), int(self.sizes[i]), int(self.numbers[i])

    def malformed_lines(self) -> Iterator[tuple[int, int, int]]:
        """(offset, size, line number) of each malformed line to answer, in line order."""
        for offset, size, number in self.malformed.tolist():
            yield offset, size, number


def bad_line(raw: bytes, number: int) -> LineError:
    """Why a line the plan found malformed has no usable custom_id."""
    try:
        custom_id_of(load_object(raw, number), number)
    except LineError as exc:
        return exc
    return LineError("invalid_json_line", f"line {number}: the line changed after the job was planned")


def _confirm_duplicates(path: Path, offsets: np.ndarray, sizes: np.ndarray, numbers: np.ndarray,
                        hashes: np.ndarray, suspects: np.ndarray) -> list[str]:
    """The custom_ids that really repeat among lines whose hashes collide (a 64-bit hash
    collision between different ids would otherwise refuse a good job)."""
    seen: dict[str, int] = {}
    found: list[str] = []
    with open(path, "rb") as f:
        for i in np.flatnonzero(np.isin(hashes, suspects)):
            f.seek(int(offsets[i]))
            cid = custom_id_of(load_object(f.read(int(sizes[i])), int(numbers[i])), int(numbers[i]))
            if cid in seen:
                found.append(f"{cid!r} (lines {seen[cid]} and {int(numbers[i])})")
            else:
                seen[cid] = int(numbers[i])
    return found


def plan_job(path: str | Path, done: set[int] | frozenset[int] = frozenset(), done_without_id: int = 0) -> Plan:
    """Scan the input once and plan its run (see the module doc). `done`: id_hash of the
    custom_ids already answered; `done_without_id`: malformed lines already answered."""
    path = Path(path)
    offsets, sizes, numbers = array("q"), array("q"), array("q")
    hashes = array("Q")
    keys = [array("Q") for _ in range(len(PREFIX_CUTS) + 1)]  # the cuts, then a chat's shared part
    lengths = array("q")
    pending = array("b")  # 1: to run, 0: already answered
    malformed = array("q")  # offset, size, number of each line with no usable custom_id
    total = 0
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            size = len(raw)
            start, offset = offset, offset + size
            if not raw.strip():
                continue
            total += 1
            try:
                obj = load_object(raw, number)
                cid = custom_id_of(obj, number)
            except LineError:
                malformed.extend((start, size, number))
                continue
            h = id_hash(cid)
            try:
                text, shared = prefix_text(obj), shared_part(obj)
            except RecursionError:  # a body nested nearly as deep as the parser goes: no prefix to group by
                text, shared = "", None
            offsets.append(start)
            sizes.append(size)
            numbers.append(number)
            hashes.append(h)
            bound = len(text) if shared is None else len(shared)  # a chat: up to its last message
            for k, cut in zip(keys, PREFIX_CUTS):
                k.append(_text_hash(text[:min(cut, bound)]))
            keys[-1].append(0 if shared is None else _text_hash(shared))
            lengths.append(len(text))
            pending.append(0 if h in done else 1)
    off, siz, num = _int64(offsets), _int64(sizes), _int64(numbers)
    hs = np.frombuffer(hashes, dtype=np.uint64) if len(hashes) else np.zeros(0, np.uint64)
    values, counts = np.unique(hs, return_counts=True)
    if (counts > 1).any():
        dups = _confirm_duplicates(path, off, siz, num, hs, values[counts > 1])
        if dups:
            more = f" and {len(dups) - 5} more" if len(dups) > 5 else ""
            # no path in the message: the server answers it to clients (run-batch names its input)
            raise DuplicateCustomIds(f"custom_id must be unique; repeated: {', '.join(dups[:5])}{more}; "
                                     "nothing was run")
    run = np.frombuffer(pending, dtype=np.int8).astype(bool) if len(pending) else np.zeros(0, bool)
    key_arrays = [np.frombuffer(k, dtype=np.uint64)[run] if len(k) else np.zeros(0, np.uint64) for k in keys]
    length = _int64(lengths)[run]
    # lexsort: the last key is the primary one. Coarse prefix, finer prefixes, then longest first.
    order = np.lexsort((-length, *reversed(key_arrays)))
    resumed = int((~run).sum())
    return Plan(
        total_lines=total,
        already_done=resumed + min(done_without_id, len(malformed) // 3),
        resumed_ids=resumed,
        offsets=off[run][order], sizes=siz[run][order], numbers=num[run][order],
        malformed=_int64(malformed).reshape(-1, 3)[done_without_id:],
    )
