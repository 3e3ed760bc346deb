"""Running a planned job on an EngineClient: lines go through the server's routes
(entrypoints.openai.offline) with a bounded number in flight, so the engine stays at its
best batch while memory stays flat, and each answer is appended to the output log as it
completes."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from prelude.engine.client import EngineClient
from prelude.engine.request import PoolingParams, RequestOutput, SamplingParams
from prelude.entrypoints.batch.lines import (LineError, custom_id_or_none, error_line, load_object, parse_line,
                                             response_line)
from prelude.entrypoints.batch.output import OutputLog
from prelude.entrypoints.batch.plan import Plan, bad_line, plan_job
from prelude.entrypoints.openai.limits import ServerLimits
from prelude.entrypoints.openai.lora_adapters import ServedAdapters
from prelude.entrypoints.openai.offline import answer
from prelude.heap import NativeHeapTrim

logger = logging.getLogger("prelude.batch")

MALFORMED_PER_YIELD = 64  # malformed lines answered between two turns of the event loop


@dataclass(frozen=True)
class JobOptions:
    max_inflight: int = 128  # lines in the engine at once: enough to fill its steps, few enough to stay flat
    limits: ServerLimits = field(default_factory=ServerLimits)
    fsync_every: int = 64  # output lines per fsync (and at least one fsync a second)
    progress: bool = False  # a tqdm bar on stderr
    endpoint: str | None = None  # /v1/batches: every line's url must be the batch's endpoint
    adapters: ServedAdapters | None = None  # LoRA adapters a line's `model` may name
    unavailable_retries: int = 5  # a line whose engine replica died under it runs again this often
    # /v1/batches on a serving engine: the lines are low-priority requests, which the
    # scheduler runs behind the interactive ones (SchedulerConfig.low_priority_step_tokens).
    low_priority: bool = False
    heap_trim_s: float = 5.0  # the C heap's free pages handed back this often (0: never; heap.NativeHeapTrim)


@dataclass
class JobSummary:
    total_lines: int = 0
    already_done: int = 0  # skipped: answered by an earlier run (--resume)
    already_failed: int = 0  # of OUTPUT's earlier lines, the failed ones (the exit status counts them)
    foreign_lines: int = 0  # OUTPUT's earlier lines whose custom_id INPUT lacks
    by_status: Counter[str] = field(default_factory=Counter)  # "200", "400", ..., "error"
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    repaired_bytes: int = 0
    cancelled: bool = False

    @property
    def ran(self) -> int:
        return sum(self.by_status.values())

    @property
    def failed(self) -> int:
        return sum(n for status, n in self.by_status.items() if status != "200")

    def describe(self) -> str:
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.by_status.items())) or "none"
        rate = self.ran / self.wall_s if self.wall_s > 0 else 0.0
        toks = (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else 0.0
        earlier = f" ({self.already_failed} of OUTPUT's earlier lines failed)" if self.already_failed else ""
        return (f"{self.ran} lines run ({statuses}), {self.already_done} already done{earlier}, {self.failed} failed; "
                f"{self.prompt_tokens} prompt + {self.output_tokens} output tokens in {self.wall_s:.1f} s "
                f"({rate:.1f} req/s, {toks:.0f} tok/s)")


class _Counting:
    """The engine, counting the tokens of what passes through it (for the progress bar),
    and marking the job's requests low-priority when it runs beside interactive traffic."""

    def __init__(self, engine: EngineClient, summary: JobSummary, low_priority: bool = False) -> None:
        self._engine, self._summary, self._low_priority = engine, summary, low_priority

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        if self._low_priority:
            params = replace(params, low_priority=True)
        stream = self._engine.generate(request_id, prompt_token_ids, params, **kwargs)
        first = True
        try:
            async for out in stream:
                if first:
                    self._summary.prompt_tokens += out.num_prompt_tokens
                    first = False
                self._summary.output_tokens += len(out.new_token_ids)
                yield out
        finally:
            await stream.aclose()

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams,
                     **kwargs: Any) -> RequestOutput:
        if self._low_priority:
            pooling = replace(pooling, low_priority=True)
        out = await self._engine.encode(request_id, prompt_token_ids, pooling, **kwargs)
        self._summary.prompt_tokens += out.num_prompt_tokens
        return out


class _Progress:
    def __init__(self, total: int, summary: JobSummary, enabled: bool) -> None:
        self._summary = summary
        self._bar = None
        self._t0 = time.monotonic()
        self._shown = 0.0
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", dynamic_ncols=True, smoothing=0.1)

    def update(self) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.monotonic()
        if now - self._shown >= 0.5:
            self._shown = now
            s = self._summary
            self._bar.set_postfix_str(f"{(s.prompt_tokens + s.output_tokens) / max(now - self._t0, 1e-9):.0f} tok/s, "
                                      f"{s.failed} failed", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _answer_line(engine: Any, raw: bytes, number: int, options: JobOptions) -> tuple[str, bytes]:
    """(status key, output line) of one input line: never raises for bad input."""
    try:
        line = parse_line(load_object(raw, number), number)
        if options.endpoint is not None and line.url != options.endpoint:
            raise LineError("mismatched_url", f"line {number}: url {line.url!r} is not the batch's endpoint "
                                              f"{options.endpoint!r}")
    except LineError as exc:
        return "error", error_line(custom_id_or_none(raw, number), exc.code, exc.message)
    for attempt in range(options.unavailable_retries + 1):
        status, body = await answer(engine, line.url, line.body, options.limits, len(raw), options.adapters)
        # A replica that died under the line (scale-out): the cluster client moves requests
        # that had not answered yet; one that had started fails with this code. The line
        # runs again rather than being lost to the job.
        if status != 503 or b'"engine_unavailable"' not in body or attempt == options.unavailable_retries:
            break
        logger.warning("line %d: %s; running it again", number, body[:200].decode(errors="replace"))
        await asyncio.sleep(min(5.0, 0.5 * 2**attempt))
    return str(status), response_line(line.custom_id, status, body)


async def run_planned(engine: EngineClient, input_path: str | Path, plan: Plan, log: OutputLog,
                      options: JobOptions, summary: JobSummary, stop: asyncio.Event | None = None,
                      on_line: Callable[[str], None] | None = None) -> JobSummary:
    """Run `plan`'s lines, appending each answer to `log`. `stop` set: no further line
    starts (cancel), the ones in flight finish."""
    counting = _Counting(engine, summary, options.low_priority)
    progress = _Progress(plan.to_run, summary, options.progress)
    t0 = time.monotonic()

    trim = NativeHeapTrim(options.heap_trim_s) if options.heap_trim_s > 0 else None

    def finished(status: str, line: bytes) -> None:
        if trim is not None:
            trim.maybe()
        log.append(line)
        summary.by_status[status] += 1
        progress.update()
        if on_line is not None:
            on_line(status)

    try:
        slots = asyncio.Semaphore(max(1, options.max_inflight))
        running: set[asyncio.Task[None]] = set()

        async def one(raw: bytes, number: int) -> None:
            try:
                status, line = await _answer_line(counting, raw, number, options)
                finished(status, line)
            finally:
                slots.release()

        fd = os.open(input_path, os.O_RDONLY)
        try:
            # first and in line order: a resumed run counts them back
            for i, (offset, size, number) in enumerate(plan.malformed_lines()):
                bad = bad_line(os.pread(fd, size, offset), number)
                finished("error", error_line(None, bad.code, bad.message))
                if i % MALFORMED_PER_YIELD == MALFORMED_PER_YIELD - 1:
                    await asyncio.sleep(0)  # a server's other requests between them (a flood held /health 11 s)
            for offset, size, number in plan.lines():
                await slots.acquire()
                if stop is not None and stop.is_set():
                    slots.release()
                    summary.cancelled = True
                    break
                task = asyncio.create_task(one(os.pread(fd, size, offset), number))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
        finally:
            os.close(fd)
            for task in running:
                task.cancel()
    finally:
        summary.wall_s += time.monotonic() - t0
        progress.close()
        log.sync()
    return summary


async def run_job(engine: EngineClient, input_path: str | Path, output_path: str | Path,
                  options: JobOptions = JobOptions(), resume: bool = False) -> JobSummary:
    """Plan and run the whole job (what `prelude run-batch` does). Raises
    DuplicateCustomIds (nothing run) or OutputFileError (OUTPUT not resumable)."""
    log = OutputLog(output_path, resume=resume, fsync_every=options.fsync_every)
    try:
        t0 = time.monotonic()
        plan = plan_job(input_path, log.done, log.done_without_id)
        log.open()
        logger.info("planned %d lines (%d to run, %d already done) in %.2f s",
                    plan.total_lines, plan.to_run, plan.already_done, time.monotonic() - t0)
        summary = JobSummary(total_lines=plan.total_lines, already_done=plan.already_done,
                             already_failed=log.done_failed, foreign_lines=len(log.done) - plan.resumed_ids,
                             repaired_bytes=log.repaired_bytes)
        return await run_planned(engine, input_path, plan, log, options, summary)
    finally:
        log.close()
