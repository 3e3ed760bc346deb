"""The server's batch runner: batches run one at a time on the server's engine, through
the same job code as `prelude run-batch`, behind interactive requests.

Priority is the scheduler's: batch lines go in as low-priority requests, which get no
prompt tokens while an interactive prompt waits and a small bound a step while
interactive requests run (engine/scheduler.py). Here only `max_inflight` bounds the
lines in the engine at once: enough to fill its steps when nobody else asks, few enough
that they never hold every sequence slot an interactive request needs.

State lives in the BatchStore: a restarted server puts every batch that was not finished
back in the queue, and its work log (an append-only run-batch output) says which lines
are already answered."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from prelude.engine.client import EngineClient
from prelude.entrypoints.batch.job import JobOptions, JobSummary, run_planned
from prelude.entrypoints.batch.lines import succeeded
from prelude.entrypoints.batch.output import OutputLog
from prelude.entrypoints.batch.plan import DuplicateCustomIds, plan_job
from prelude.entrypoints.batch.store import ACTIVE, BatchStore
from prelude.entrypoints.openai.limits import ServerLimits
from prelude.entrypoints.openai.lora_adapters import ServedAdapters

logger = logging.getLogger("prelude.batch")


@dataclass(frozen=True)
class BatchRunnerConfig:
    max_inflight: int = 32  # batch lines in the engine at once (keep it under --max-num-seqs)
    save_interval_s: float = 1.0  # request_counts written to disk at most this often


class BatchRunner:
    def __init__(self, engine: EngineClient, store: BatchStore, limits: ServerLimits,
                 config: BatchRunnerConfig = BatchRunnerConfig(), adapters: ServedAdapters | None = None) -> None:
        self._engine, self.store, self._limits, self.config = engine, store, limits, config
        self._adapters = adapters
        self._queue: asyncio.Queue[str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._live: dict[str, dict[str, Any]] = {}  # batches being run: their up-to-date records
        self._stops: dict[str, asyncio.Event] = {}

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start the loop (on the server's event loop) and queue every unfinished batch."""
        if self._task is not None:
            return
        self._queue = asyncio.Queue()
        for batch in self.store.batches():
            if batch["status"] in ACTIVE:
                logger.info("resuming batch %s (%s)", batch["id"], batch["status"])
                self._queue.put_nowait(batch["id"])
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def submit(self, batch_id: str) -> None:
        self.start()
        assert self._queue is not None
        self._queue.put_nowait(batch_id)

    # --- what the routes read and do -----------------------------------------------

    def record(self, batch_id: str) -> dict[str, Any] | None:
        return self._live.get(batch_id) or self.store.batch(batch_id)

    def cancel(self, batch_id: str) -> dict[str, Any] | None:
        batch = self.record(batch_id)
        if batch is None or batch["status"] not in ("validating", "in_progress"):
            return batch  # finished, failed, or already being cancelled: unchanged (as OpenAI)
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        self.store.save_batch(batch)
        stop = self._stops.get(batch_id)
        if stop is not None:
            stop.set()  # running: its lines in flight finish, then _run closes it
        elif batch_id not in self._live:
            self._finish(batch, cancelled=True)  # queued: nothing runs, so nothing to wait for
        return batch

    # --- the loop ------------------------------------------------------------------

    async def _loop(self) -> None:
        assert self._queue is not None
        while True:
            batch_id = await self._queue.get()
            batch = self.store.batch(batch_id)
            if batch is None or batch["status"] not in ACTIVE:
                continue
            try:
                await self._run(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the batch fails, the server goes on
                logger.exception("batch %s failed", batch_id)
                try:
                    self._fail(batch, "batch_failed", f"{type(exc).__name__}: {exc}")
                except Exception:  # noqa: BLE001 - the loop must outlive one batch's disk trouble
                    logger.exception("batch %s: its failure could not be recorded", batch_id)
            finally:
                self._live.pop(batch_id, None)
                self._stops.pop(batch_id, None)

    def _fail(self, batch: dict[str, Any], code: str, message: str) -> None:
        """Close the batch as failed; the lines it answered before are still delivered."""
        batch["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
        self._deliver(batch)
        batch["status"], batch["failed_at"] = "failed", int(time.time())
        self.store.save_batch(batch)
        self.store.work_log(batch["id"]).unlink(missing_ok=True)

    async def _run(self, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        self._live[batch_id] = batch
        stop = self._stops.setdefault(batch_id, asyncio.Event())
        if batch["status"] == "cancelling":
            self._finish(batch, cancelled=True)
            return
        source = self.store.file_path(batch["input_file_id"])
        if not source.exists():
            self._fail(batch, "missing_input_file", f"the input file {batch['input_file_id']} no longer exists")
            return
        work = self.store.work_log(batch_id)
        log = OutputLog(work, resume=True)
        try:
            plan = await asyncio.to_thread(plan_job, source, log.done, log.done_without_id)
        except DuplicateCustomIds as exc:
            self._fail(batch, "duplicate_custom_id", str(exc))
            return
        if plan.total_lines == 0:
            self._fail(batch, "empty_file", f"the input file {batch['input_file_id']} has no request lines")
            return
        batch["request_counts"] = {"total": plan.total_lines, "completed": log.done_lines - log.done_failed,
                                   "failed": log.done_failed}
        if batch["status"] == "validating":
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
        self.store.save_batch(batch)
        saved = time.monotonic()

        def on_line(status: str) -> None:
            nonlocal saved
            counts = batch["request_counts"]
            counts["completed" if status.startswith("2") else "failed"] += 1
            if time.monotonic() - saved >= self.config.save_interval_s:
                self.store.save_batch(batch)
                saved = time.monotonic()

        if batch["status"] == "in_progress":
            options = JobOptions(max_inflight=self.config.max_inflight, limits=self._limits,
                                 endpoint=batch["endpoint"], adapters=self._adapters, low_priority=True)
            log.open()
            try:
                await run_planned(self._engine, source, plan, log, options, JobSummary(), stop=stop,
                                  on_line=on_line)
            finally:
                log.close()
        # off the event loop: a large batch's work log took the server's other requests seconds
        await asyncio.to_thread(self._finish, batch, stop.is_set() or batch["status"] == "cancelling")

    def _finish(self, batch: dict[str, Any], cancelled: bool) -> None:
        """Deliver the work log and close the batch."""
        if not cancelled:
            batch["status"], batch["finalizing_at"] = "finalizing", int(time.time())
            self.store.save_batch(batch)
        self._deliver(batch)
        now = int(time.time())
        if cancelled:
            batch["status"], batch["cancelled_at"] = "cancelled", now
        else:
            batch["status"], batch["completed_at"] = "completed", now
        self.store.save_batch(batch)
        self.store.work_log(batch["id"]).unlink(missing_ok=True)

    def _deliver(self, batch: dict[str, Any]) -> None:
        """Split the work log into the output file (2xx answers) and the error file (the
        rest), as OpenAI does, and count them."""
        ok_id, err_id = self.store.new_file_id(), self.store.new_file_id()
        ok = failed = 0
        with open(self.store.file_path(ok_id), "wb") as good, open(self.store.file_path(err_id), "wb") as bad:
            try:
                with open(self.store.work_log(batch["id"]), "rb") as f:
                    for raw in f:
                        if not raw.endswith(b"\n"):
                            break  # a torn last line (a server killed mid-write, then the batch failed)
                        if succeeded(json.loads(raw)):
                            good.write(raw)
                            ok += 1
                        else:
                            bad.write(raw)
                            failed += 1
            except FileNotFoundError:
                pass
        name = batch["id"]
        batch["output_file_id"] = self.store.add_file(ok_id, f"{name}_output.jsonl", "batch_output")["id"] if ok else None
        batch["error_file_id"] = self.store.add_file(err_id, f"{name}_error.jsonl", "batch_output")["id"] if failed else None
        for unused, kept in ((ok_id, ok), (err_id, failed)):
            if not kept:
                self.store.file_path(unused).unlink(missing_ok=True)
        batch["request_counts"].update(completed=ok, failed=failed)
