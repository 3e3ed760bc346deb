"""One HTTP request -> several engine sequences (prompts x n), merged back into choices."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from starlette.requests import Request as HTTPRequest

from prelude.engine.client import EngineClient, ReplicaLostError
from prelude.engine.request import RequestOutput, SamplingParams, TokenLogprob
from prelude.entrypoints.openai.disconnect import until_disconnect

logger = logging.getLogger("prelude.server")

# A non-streamed answer whose replica died after producing output runs again from the start
# (nothing reached its client), at most this many times.
MAX_RERUNS = 2


@dataclass(frozen=True)
class Job:
    """One engine sequence: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.text
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs)
        if out.finished and out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value
            self.stop_reason = out.stop_reason


def fan_out(prompts: list[list[int]], params: SamplingParams) -> list[Job]:
    """Choice i of a seeded request uses seed + i: choices differ, the request is reproducible."""
    jobs = []
    for p_idx, ids in enumerate(prompts):
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed + i) % 2**64  # stays a valid seed
            jobs.append(Job(p_idx * params.n + i, p_idx, ids, replace(params, n=1, seed=seed)))
    return jobs


async def merged_outputs(engine: EngineClient, request_id: str, jobs: list[Job]) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Increments of all jobs as they arrive. Closing this iterator early aborts every job."""
    if len(jobs) == 1:  # one sequence: its own stream, no pump task and queue between
        (job,) = jobs
        async with aclosing(engine.generate(f"{request_id}-{job.index}", job.prompt_ids, job.params)) as stream:
            async for out in stream:
                yield job, out
        return
    queue: asyncio.Queue[tuple[Job, RequestOutput | Exception]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for out in engine.generate(f"{request_id}-{job.index}", job.prompt_ids, job.params):
                await queue.put((job, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((job, exc))

    tasks = [asyncio.create_task(pump(j)) for j in jobs]
    remaining = len(jobs)
    try:
        while remaining:
            job, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
            yield job, item
    finally:
        # Cancelling a pump closes its engine stream, which aborts that sequence.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(
    engine: EngineClient, request_id: str, jobs: list[Job], http_request: HTTPRequest | None
) -> list[Choice]:
    """Run all jobs to completion; cancel them if the HTTP client goes away. The client
    sees nothing before the end, so when a replica dies under a job with output
    (ReplicaLostError) every job runs again from the start, at most MAX_RERUNS times."""

    async def consume() -> list[Choice]:
        for rerun in range(MAX_RERUNS + 1):
            choices = [Choice(j.index) for j in jobs]
            try:
                async with aclosing(merged_outputs(engine, request_id, jobs)) as outputs:
                    async for job, out in outputs:
                        choices[job.index].add(out)
                return choices
            except ReplicaLostError as exc:
                if rerun == MAX_RERUNS:
                    raise
                logger.warning("request %s: %s; running it again from the start (%d of at most %d)",
                               request_id, exc, rerun + 1, MAX_RERUNS)
        raise AssertionError("unreachable")

    return await until_disconnect(consume(), http_request)
