"""Builds one ForwardBatch per step under explicit budgets.

Every step: running requests first (decode rows and unfinished prompt chunks), in
policy order, each getting the tokens it still needs up to the token budget; when the
KV pool has no room, the policy's last running request is preempted (its blocks freed,
to be recomputed later). Then waiting requests are admitted in policy order while the
token budget, `max_num_seqs` and the KV pool (minus a small watermark kept for running
decodes) allow. Long prompts are chunked by the token budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prelude.config import SchedulerConfig
from prelude.engine.batch import BatchRow, DecodeBatch, ForwardBatch, MixedBatch, SampleSpec
from prelude.engine.policies import SchedulingPolicy
from prelude.engine.request import Request, RequestStatus
from prelude.kv.kv_manager import KVCacheManager


@dataclass
class ScheduleResult:
    batch: ForwardBatch | None
    scheduled: dict[str, int] = field(default_factory=dict)  # request_id -> tokens computed this step
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: SchedulingPolicy) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Keep ~1% of the pool free at admission so running decodes rarely preempt.
        self.watermark_blocks = max(1, kv.pool.num_blocks // 100)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _row(self, req: Request, n: int) -> BatchRow:
        start = req.num_computed_tokens
        n_prompt = req.num_prompt_tokens
        if start >= n_prompt:  # decode (or recompute) past the prompt: read outputs only
            tokens = req.output_token_ids[start - n_prompt : start - n_prompt + n]
        elif start + n <= n_prompt:
            tokens = req.prompt_token_ids[start : start + n]
        else:
            tokens = req.all_token_ids[start : start + n]
        sample = None
        if start + n == req.num_tokens:
            # The token lists are shared, not copied: the batch is consumed before
            # postprocessing appends the next token.
            sample = SampleSpec(req.params, req.prompt_token_ids, req.output_token_ids, req.generator)
        return BatchRow(req.request_id, tokens, start, list(self.kv.block_table(req.request_id)), sample)

    def _preempt(self, victim: Request, result: ScheduleResult) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.waiting.append(victim)
        result.preempted.append(victim)

    def schedule(self, now: float | None = None) -> ScheduleResult:
        now = time.monotonic() if now is None else now
        result = ScheduleResult(batch=None)
        budget = self.config.max_num_batched_tokens
        rows: list[BatchRow] = []

        queue = self.policy.order_running(self.running, now)
        while queue and budget > 0:
            req = queue.pop(0)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = queue.pop() if queue else req
                self._preempt(victim, result)
                if victim is req:
                    break
            else:
                rows.append(self._row(req, n))
                result.scheduled[req.request_id] = n
                budget -= n

        if not result.preempted:
            for req in self.policy.order_waiting(self.waiting, now):
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self.kv.allocate(req.request_id, req.num_computed_tokens + n, reserve=self.watermark_blocks):
                    break
                self.waiting.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                rows.append(self._row(req, n))
                result.scheduled[req.request_id] = n
                budget -= n

        if rows:
            decode: list[BatchRow] = []
            prefill: list[BatchRow] = []
            for r in rows:
                is_decode = r.sample is not None and len(r.token_ids) == 1 and r.start_pos > 0
                (decode if is_decode else prefill).append(r)
            result.batch = MixedBatch(tuple(prefill), tuple(decode)) if prefill else DecodeBatch(tuple(decode))
        return result
