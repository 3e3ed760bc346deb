"""A job's output file as an append-only log: each finished line is one write (so a
`kill -9` leaves whole lines, or at worst one half-written last line), fsynced in groups.
Resuming reads which custom_ids are already there and repairs a torn last line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prelude.entrypoints.batch.lines import id_hash, succeeded


class OutputFileError(ValueError):
    """OUTPUT can not be resumed (a line in the middle is not a batch output line)."""


class OutputLog:
    def __init__(self, path: str | Path, resume: bool, fsync_every: int = 64, fsync_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.done: set[int] = set()  # id_hash of every custom_id already answered
        self.done_without_id = 0  # lines answered for malformed input lines (no custom_id)
        self.done_lines = 0  # whole lines already there
        self.done_failed = 0  # of them, the ones that carry an error or a non-2xx answer
        self.repaired_bytes = 0  # a torn last line's, cut when the job opens OUTPUT
        self._whole_bytes = 0
        self._resume = resume
        if resume and self.path.exists():
            self._read_done()
        self._fd = -1
        self._fsync_every, self._fsync_interval_s = fsync_every, fsync_interval_s
        self._unsynced = 0
        self._synced_at = time.monotonic()
        self.appended = 0

    def _read_done(self) -> None:
        keep = 0  # bytes of whole lines
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    break  # the torn last line of a killed run: cut off, its request runs again
                try:
                    line = json.loads(raw)
                    cid = line["custom_id"]
                    if not isinstance(cid, (str, type(None))) or not isinstance(line.get("response") or {}, dict):
                        raise TypeError
                except (ValueError, KeyError, TypeError):
                    raise OutputFileError(f"{self.path}: line {number} is not a batch output line; "
                                          "resume only into a file this job wrote") from None
                if cid is None:
                    self.done_without_id += 1
                else:
                    self.done.add(id_hash(cid))
                if not succeeded(line):
                    self.done_failed += 1
                self.done_lines += 1
                keep += len(raw)
        # cut in open(): a job refused while planning leaves OUTPUT as it was
        self._whole_bytes = keep
        self.repaired_bytes = self.path.stat().st_size - keep

    def open(self) -> None:
        """Start writing (after planning, so a refused job leaves an old OUTPUT as it was):
        appending when resuming, from empty otherwise."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (0 if self._resume else os.O_TRUNC)
        self._fd = os.open(self.path, flags, 0o644)
        if self.repaired_bytes:  # the torn last line of a killed run: cut off, its request runs again
            os.ftruncate(self._fd, self._whole_bytes)

    def append(self, line: bytes) -> None:
        """One write per line: O_APPEND keeps concurrent lines whole."""
        os.write(self._fd, line)
        self.appended += 1
        self._unsynced += 1
        if self._unsynced >= self._fsync_every or time.monotonic() - self._synced_at >= self._fsync_interval_s:
            self.sync()

    def sync(self) -> None:
        if self._unsynced and self._fd >= 0:
            os.fsync(self._fd)
            self._unsynced = 0
        self._synced_at = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1
