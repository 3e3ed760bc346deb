"""The server's files and batches on disk (under `--batch-dir`): what /v1/files and
/v1/batches answer, and what a restarted server resumes from. Each record is a JSON file
replaced atomically; a file's bytes sit beside its record."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

# Batch states (OpenAI's); the first four are resumed by a restarted server.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "cancelled", "expired")


def default_batch_dir() -> Path:
    from prelude.cache_dirs import cache_root

    return cache_root() / "batches"


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class BatchStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)

    # --- files ---------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.data"

    def _file_record_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.json"

    def new_file_id(self) -> str:
        return f"file-{_ordered_hex()}"

    def add_file(self, file_id: str, filename: str, purpose: str) -> dict[str, Any]:
        """Record a file whose bytes are already at file_path(file_id)."""
        record = {"id": file_id, "object": "file", "bytes": self.file_path(file_id).stat().st_size,
                  "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                  "status": "processed", "expires_at": None, "status_details": None}
        _write_json(self._file_record_path(file_id), record)
        return record

    def file(self, file_id: str) -> dict[str, Any] | None:
        if not _is_id(file_id, "file-"):
            return None
        try:
            return json.loads(self._file_record_path(file_id).read_text())
        except FileNotFoundError:
            return None

    def files(self) -> Iterator[dict[str, Any]]:
        for path in self.files_dir.glob("file-*.json"):
            try:
                yield json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                continue

    def delete_file(self, file_id: str) -> bool:
        if self.file(file_id) is None:
            return False
        self._file_record_path(file_id).unlink(missing_ok=True)
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    # --- batches -------------------------------------------------------------------

    def _batch_path(self, batch_id: str) -> Path:
        return self.batches_dir / f"{batch_id}.json"

    def work_log(self, batch_id: str) -> Path:
        """Every answered line of the batch, as run-batch writes them (resumable)."""
        return self.batches_dir / f"{batch_id}.work.jsonl"

    def new_batch(self, endpoint: str, input_file_id: str, completion_window: str,
                  metadata: dict[str, str] | None) -> dict[str, Any]:
        now = int(time.time())
        batch = {"id": f"batch_{_ordered_hex()}", "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}
        self.save_batch(batch)
        return batch

    def save_batch(self, batch: dict[str, Any]) -> None:
        _write_json(self._batch_path(batch["id"]), batch)

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        if not _is_id(batch_id, "batch_"):
            return None
        try:
            return json.loads(self._batch_path(batch_id).read_text())
        except FileNotFoundError:
            return None

    def batches(self) -> list[dict[str, Any]]:
        found = []
        for path in self.batches_dir.glob("batch_*.json"):
            try:
                found.append(json.loads(path.read_text()))
            except (FileNotFoundError, ValueError):
                continue
        return sorted(found, key=lambda b: (b["created_at"], b["id"]))


def _ordered_hex() -> str:
    """An id's hex: the creation time in nanoseconds, then random bits. Lists sort by
    (created_at, id), and created_at counts whole seconds: ids that sort by time keep a
    second's batches newest-first, and a restarted server resumes them first-in first-out."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def _is_id(value: str, prefix: str) -> bool:
    """Ids name files on disk: only ours (prefix + hex) get that far."""
    rest = value.removeprefix(prefix)
    return value.startswith(prefix) and 0 < len(rest) <= 64 and all(c in "0123456789abcdef" for c in rest)
