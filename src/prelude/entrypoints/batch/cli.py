"""`prelude run-batch -i INPUT -o OUTPUT [serve flags]`: an OpenAI Batch file, offline."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from prelude.entrypoints.batch.job import JobOptions, run_job
from prelude.entrypoints.batch.output import OutputFileError
from prelude.entrypoints.batch.plan import DuplicateCustomIds
from prelude.heap import freeze_startup_heap

logger = logging.getLogger("prelude.batch")


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
    except (OutputFileError, FileNotFoundError) as exc:
        print(f"prelude run-batch: {exc}", file=sys.stderr)
        return 1
    if summary.repaired_bytes:
        print(f"repaired {args.output_file}: cut a half-written last line ({summary.repaired_bytes} bytes); "
              "its request ran again", file=sys.stderr)
    print(f"prelude run-batch: {summary.describe()}", file=sys.stderr)
    return 0 if summary.failed == 0 else 1
