"""`prelude run-batch -i INPUT -o OUTPUT [serve flags]`: an OpenAI Batch file, offline."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any

from prelude.entrypoints.batch.job import JobOptions, run_job
from prelude.entrypoints.batch.output import OutputFileError
from prelude.entrypoints.batch.plan import DuplicateCustomIds
from prelude.heap import freeze_startup_heap
from prelude.startup import StartupError

logger = logging.getLogger("prelude.batch")


def check_job_paths(input_file: str, output_file: str) -> None:
    """INPUT and OUTPUT as a job needs them, before the model loads; raises StartupError.
    INPUT is read twice (planned, then its lines fetched by offset): a regular file, not a
    pipe. OUTPUT is appended to and resumed from: a regular file or a new one, never INPUT
    (opening it would empty the input before a line ran)."""
    source = Path(input_file)
    try:
        mode = source.stat().st_mode
    except OSError as exc:
        raise StartupError(f"INPUT {input_file}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise StartupError(f"INPUT {input_file} is not a regular file: a job reads its input twice (planned, "
                           "then run), so save a pipe's lines to a file first")
    target = Path(output_file)
    if target.exists():
        if not target.is_file():
            raise StartupError(f"OUTPUT {output_file} is not a regular file: name a file to write the answers to")
        if os.path.samefile(source, target):
            raise StartupError(f"OUTPUT {output_file} is INPUT: the answers would overwrite the requests; "
                               "name another file")
        if not os.access(target, os.W_OK):
            raise StartupError(f"OUTPUT {output_file}: permission denied")
        return
    folder = next((p for p in target.absolute().parents if p.exists()), None)
    if folder is None or not folder.is_dir():
        raise StartupError(f"OUTPUT {output_file}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise StartupError(f"OUTPUT {output_file}: cannot create files in {folder} (permission denied)")


def run_batch(args: argparse.Namespace, front: Any, limits: Any) -> int:
    """Run the job on `front` (an EngineClient); 0 when every line succeeded, 1 otherwise."""
    from prelude.entrypoints.openai.errors import APIError
    from prelude.entrypoints.openai.lora_adapters import ServedAdapters

    adapters = ServedAdapters(front)
    try:
        for name, path in args.lora_modules:
            adapters.load_at_start(name, path)
    except APIError as exc:
        print(f"prelude run-batch: {exc.message}", file=sys.stderr)
        return 1
    options = JobOptions(max_inflight=args.max_inflight or 2 * args.max_num_seqs, limits=limits,
                         progress=args.progress, adapters=adapters)
    freeze_startup_heap()  # loaded: a job's full collections skip the model, tokenizer and routes
    try:
        summary = asyncio.run(run_job(front, args.input_file, args.output_file, options, resume=args.resume))
    except DuplicateCustomIds as exc:
        print(f"prelude run-batch: {args.input_file}: {exc}", file=sys.stderr)
        return 1
    except (OutputFileError, OSError) as exc:  # OSError: a disk full, a file moved under the job
        print(f"prelude run-batch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # OUTPUT holds whole lines only (each one write)
        print(f"prelude run-batch: interrupted; {args.output_file} keeps the lines answered so far: "
              "run the same command with --resume to finish the job", file=sys.stderr)
        return 130
    if summary.repaired_bytes:
        print(f"repaired {args.output_file}: cut a half-written last line ({summary.repaired_bytes} bytes); "
              "its request ran again", file=sys.stderr)
    if summary.foreign_lines:
        print(f"prelude run-batch: {args.output_file} holds {summary.foreign_lines} lines whose custom_id is not "
              f"in {args.input_file} (another job's output?); they were kept", file=sys.stderr)
    print(f"prelude run-batch: {summary.describe()}", file=sys.stderr)
    return 0 if summary.failed == 0 and summary.already_failed == 0 else 1
