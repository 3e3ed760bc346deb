"""Builds one ForwardBatch per step under explicit budgets.

Two queues with separate accounting:
- OneShot requests wait in their own queue and are admitted by prompt tokens and an
  activation-memory estimate, grouped by output head; they get no block table and
  no KV reservation. A step with OneShot work is a `OneShotBatch`.
- Paged requests: admitted requests first (decode rows and unfinished prompt chunks),
  in policy order, each getting the tokens it still needs up to the token budget;
  when the KV pool has no room, the policy's last admitted request is preempted (its
  blocks freed, to be recomputed later). Then waiting requests are admitted in policy
  order while the token budget, `max_num_seqs` and the KV pool (minus a small
  watermark kept for running decodes) allow. Long prompts are chunked by the budget,
  except prompts whose rows feed a head (prompt logprobs, pooling), which need
  every hidden state in one forward.
When both classes have work, OneShot rows ride in the Decode/Mixed forward (fused steps,
the default): after the decode rows, OneShot prompts and paged prompts take turns at
the step's remaining token budget. With `fuse_oneshot` off, steps alternate between a
OneShot batch and a Decode/Mixed batch. Either way neither class starves the other.

A cold shared prefix is computed once. The first request that would compute and publish
it leads; a OneShot peer in the same step rides in the leader's forward (its prefix is
the blocks the leader publishes, which every layer writes before any row attends: a
judge's cold wave runs in one step instead of two); any other peer waits one step for the leader and then hits the cache.

Low-priority requests (a batch job's lines on a serving engine) yield to normal ones:
within each class normal requests go first, and low-priority prompt work gets no tokens
while a normal prompt waits, and at most `low_priority_step_tokens` a step while normal
requests run or ran within `normal_linger_s` (a closed-loop client's next request finds
at most that much low-priority work in flight), and none for `normal_return_s` after a
step with normal rows ended (that client's next request usually comes within it, and
then finds nothing of theirs in flight). Alone, they run at full steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from prelude.config import SchedulerConfig
from prelude.forward_batch import (
    BatchRow,
    DecodeBatch,
    ForwardBatch,
    HeadSpec,
    MixedBatch,
    OneShotBatch,
    OneShotRow,
    SampleSpec,
)
from prelude.engine.oneshot_gather import BurstGather
from prelude.engine.policies import SchedulingPolicy
from prelude.engine.policies.base import by_arrival
from prelude.engine.request import ExecClass, LoraRequest, PoolingTask, Request, RequestStatus
from prelude.kv.kv_manager import KVCacheManager, blocks_needed
from prelude.kv.prefix_cache import CheckpointHit


@dataclass
class ScheduleResult:
    batch: ForwardBatch | None
    scheduled: dict[str, int] = field(default_factory=dict)  # request_id -> tokens computed this step
    preempted: list[Request] = field(default_factory=list)
    oneshot: list[Request] = field(default_factory=list)  # requests of the step's OneShot rows
    # OneShot requests longer than a step whose row here is a chunk: it computes and
    # publishes prompt blocks only; they stay waiting and go on from the cache
    chunked: list[Request] = field(default_factory=list)
    adapters: set[int] = field(default_factory=set)  # LoRA adapters (ids) the step's rows run with
    # Carried rows (decode overlap): their input is the carried token, which the step in
    # flight samples for the same request. Request ids, in row order.
    carried: list[str] = field(default_factory=list)
    has_normal: bool = False  # the step has rows of normal (not low-priority) requests
    # No batch because OneShot gathering holds it: how long the hold lasts at most if
    # nothing arrives (oneshot_gather.py), so the loop naps no longer
    hold_s: float = 0.0

    @property
    def oneshot_rows(self) -> tuple[OneShotRow, ...]:
        """The rows that own no KV: a OneShot batch's, or a fused Mixed batch's."""
        if isinstance(self.batch, OneShotBatch):
            return self.batch.rows
        return self.batch.oneshot_rows if isinstance(self.batch, MixedBatch) else ()


def lora_namespace(lora: LoraRequest | None) -> str:
    """The prefix-cache namespace of an adapter's rows: K/V are shared only under the same
    adapter (the base's is "")."""
    return "" if lora is None else f"lora-{lora.id}"


def namespace(req: Request) -> str:
    return lora_namespace(req.lora)


def reuses_prefix(req: Request) -> bool:
    """Rows whose outputs need every prompt position (prompt logprobs, mean/cls pooling)
    must compute the whole prompt; the others can start after a cached prefix."""
    if req.params.prompt_logprobs is not None:
        return False
    return req.pooling is None or req.pooling.task.value != "embed" or req.pooling.pooling == "last"


def pools_running(req: Request) -> bool:
    """Mean or max pooling: pooled in chunks through a running pool (HeadSpec.pooled_before)."""
    p = req.pooling
    return p is not None and p.task.value == "embed" and p.pooling in ("mean", "max")


# A peer of a request that is computing a cold shared prefix waits at most this many
# steps for it to land in the cache, then computes whatever is still missing.
MAX_DEFER_STEPS = 1


@dataclass(frozen=True)
class OneShotLeader:
    """A OneShot row of this step that computes and publishes a cold shared prefix: its
    shareable tokens, its cached prefix's length in blocks and the blocks it publishes.
    A peer whose prompt starts with the same blocks rides in the same forward: it reads
    them from the pool, where every layer writes the step's new K/V before it attends."""

    tokens: list[int]
    cached_blocks: int
    publish_blocks: tuple[int, ...]

    def shared_blocks(self, tokens: list[int], block_size: int) -> tuple[int, ...]:
        """The leader's publish blocks that `tokens` (a peer's shareable prompt with the same
        cached prefix) starts with, leaving the peer at least one token of its own."""
        shared = 0
        for i in range(len(self.publish_blocks)):
            lo, hi = (self.cached_blocks + i) * block_size, (self.cached_blocks + i + 1) * block_size
            if hi > len(tokens) - 1 or tokens[lo:hi] != self.tokens[lo:hi]:
                break
            shared += 1
        return self.publish_blocks[:shared]


_PREFIX_CHUNK = 64


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of a and b: equal 64-token slices skipped,
    then token by token. A binary search over whole-prefix slices copied O(n log n) tokens a
    pair, for every pair of a wave at every engine iteration of a burst's gathering, on the
    engine thread, holding the GIL the HTTP thread needed to parse the rest of the burst."""
    n, i = min(len(a), len(b)), 0
    while i + _PREFIX_CHUNK <= n and a[i:i + _PREFIX_CHUNK] == b[i:i + _PREFIX_CHUNK]:
        i += _PREFIX_CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shareable_tokens(req: Request) -> list[int]:
    """The part of a OneShot prompt the prefix cache may look up and publish: all of it, or
    for a multi-item prompt the shared part only (items' K/V sit at restarted positions)."""
    if req.pooling is not None and req.pooling.item_lens:
        return req.prompt_token_ids[: req.pooling.shared_len(req.num_prompt_tokens)]
    return req.prompt_token_ids


def head_spec(req: Request, chunk: bool = False) -> HeadSpec | None:
    """`chunk`: the head of a chunk of a running pool (it returns the pool so far)."""
    if req.head_done or (req.pooling is None and req.params.prompt_logprobs is None):
        return None
    pooling = req.pooling
    if req.pooled_upto and pooling is not None:  # the prompt's tokens still to skip, after those pooled
        pooling = replace(pooling, skip_tokens=max(0, pooling.skip_tokens - req.pooled_upto))
    return HeadSpec(prompt_logprobs=req.params.prompt_logprobs, pooling=pooling, pooled_before=req.pooled,
                    pool_chunk=chunk)


def sample_spec(req: Request, carried: int = 0) -> SampleSpec | None:
    """`carried`: tokens sampled by the step in flight, not yet in output_token_ids (a
    carried row); they count toward the output position the seed mixes in."""
    if len(req.output_token_ids) + carried >= req.max_output_tokens:
        return None  # nothing (more) to generate: a head-only request
    # The token lists are shared, not copied: the batch is consumed before
    # postprocessing appends the next token.
    mask = req.grammar.bitmask() if req.grammar is not None else None  # structured outputs: allowed tokens
    return SampleSpec(req.params, req.prompt_token_ids, req.output_token_ids, req.sampling_seed, mask, carried)


# The input id a carried row is built with: its real token, the carried token, is sampled by
# the step in flight and copied into the inputs on the device (ModelRunner.launch's `carried`).
CARRIED_TOKEN_PLACEHOLDER = 0


def can_carry(req: Request, max_model_len: int) -> bool:
    """Whether a request whose step is in flight (sampling its next token) may get a
    carried row: its next decode row, scheduled before that token is on the host. Rows
    whose next step needs the token on the host opt out and wait one step: a grammar (the mask follows the token),
    penalties (they count output tokens), a hand-off (it ends after the first token).
    The in-flight token must not be its last (max_tokens, the context)."""
    p = req.params
    return (req.grammar is None and not req.hand_off and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty
            and len(req.output_token_ids) + 1 < req.max_output_tokens and req.num_tokens + 1 < max_model_len)


def is_decoding(req: Request) -> bool:
    """Past its prompt with exactly one token to compute: a decode row, not prompt work."""
    return req.num_tokens - req.num_computed_tokens == 1 and req.num_computed_tokens >= req.num_prompt_tokens


def oneshot_group(req: Request) -> tuple[object, ...]:
    """Requests batched into one OneShot step share a head and compatible options."""
    p = req.pooling
    if p is not None:
        # Label scores and whole-label logprobs both read the LM head: one group, so that a
        # request's rows of both kinds (a typed decision's) share one step.
        task = PoolingTask.LABELS if p.task is PoolingTask.SEQUENCE_LOGPROBS else p.task
        return ("pool", task, p.pooling, p.normalize)
    return ("generate", req.params.prompt_logprobs is not None)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, policy: SchedulingPolicy, vocab_size: int, hidden_size: int
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting: list[Request] = []
        # Admitted Paged requests (status RUNNING): they hold KV blocks until they finish or
        # are preempted. `oneshot_admitted`: OneShot requests taken into a step, until it ends.
        self.admitted: list[Request] = []
        self.oneshot_waiting: list[Request] = []
        self.oneshot_admitted: set[Request] = set()  # Requests hash by identity
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self._last_was_oneshot = False
        self._oneshot_turn = True  # fused steps: OneShot prompts go before paged prompts
        self._in_flight: Mapping[str, int] = {}  # this schedule: requests of the step in flight -> its tokens
        # Keep ~1% of the pool free at admission so running decodes rarely preempt.
        self.watermark_blocks = max(1, kv.pool.num_blocks // 100)
        self.gather = BurstGather(config.oneshot_gather_ms / 1000)
        self._normal_at = float("-inf")  # when normal requests were last in the queues
        self._normal_step_end = float("-inf")  # when the last step with normal rows ended
        # This step: the prompt tokens low-priority rows may still take (None: no bound), and
        # the bound it started from (a low-priority OneShot row over it may go alone).
        self._low_priority_left: int | None = None
        self._low_priority_cap: int | None = None
        self._chunking: set[str] = set()  # OneShot requests whose chunk is in a step not yet ended
        # Models with recurrent layers: where an admitted request's prompt parts from the cached
        # ones (past its hit), for its first row's checkpoint (taken by _row)
        self._parts: dict[str, int] = {}

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if request.exec_class is ExecClass.ONESHOT:
            self.oneshot_waiting.append(request)
        else:
            self.waiting.append(request)

    def adopt(self, request: Request, num_computed: int, write: Callable[[list[int]], None]) -> bool:
        """A request whose first `num_computed` tokens another engine computed (a KV
        hand-off): blocks for them, filled by `write(block_table)`, and a place among the
        admitted requests. It bypasses `max_num_seqs` (the sender's cap on hand-offs bounds
        this) but keeps the watermark admissions keep; False (nothing taken) when the pool
        has no room. If `write` raises, the blocks are freed before the error goes on."""
        if not self.kv.allocate(request.request_id, num_computed, reserve=self.watermark_blocks):
            return False
        try:
            write(list(self.kv.block_table(request.request_id)))
        except BaseException:
            self.kv.free(request.request_id)
            raise
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.admitted.append(request)
        return True

    def computed_blocks(self, request: Request) -> list[int]:
        """The blocks holding the request's computed tokens, in table order (a hand-off
        copies them out before `finish` lets go of them)."""
        return self.kv.block_table(request.request_id)[: blocks_needed(request.num_computed_tokens, self.kv.block_size)]

    def end_step(self, plan: ScheduleResult, ok: bool, now: float | None = None) -> None:
        """The step's forward is over: release what the step held. On success, the paged
        rows' computed counts advance and their filled blocks join the prefix cache, and
        the OneShot rows' full prompt blocks are published; on failure nothing is
        published (the blocks may hold partial KV). Either way the OneShot rows' holds
        end here. A request aborted while its step was in flight is skipped: it left
        `admitted` and its blocks are already free."""
        if plan.has_normal:
            self._normal_step_end = time.monotonic() if now is None else now
        admitted = {r.request_id: r for r in self.admitted}
        if ok:
            for request_id, n in plan.scheduled.items():
                req = admitted.get(request_id)
                if req is None:
                    continue
                req.num_computed_tokens += n
                if n > 1 or req.num_computed_tokens % self.kv.block_size == 0:  # a block just filled
                    self.kv.cache_computed(request_id, req.all_token_ids, req.num_computed_tokens, namespace(req))
        if self.kv.checkpoints is not None and isinstance(plan.batch, (DecodeBatch, MixedBatch)):
            for row in plan.batch.rows:  # state checkpoints: attached to the blocks just cached, or freed
                req = admitted.get(row.request_id)
                if row.state_saves:
                    self.kv.end_saves(req.all_token_ids if req is not None else [], row.state_saves,
                                      ok and req is not None, namespace(req) if req is not None else "")
                if ok and row.restore_slot is not None and req is not None:
                    self.kv.restored(row.request_id)  # (a failed row's request is aborted: free lets go)
        if ok and plan.oneshot:
            self.gather.step_ended(len(plan.oneshot), len(self.oneshot_waiting), time.monotonic())
        self._chunking.difference_update(r.request_id for r in plan.chunked)
        for row in plan.oneshot_rows:
            if ok:
                self.kv.end_step(row.token_ids, list(row.prefix_blocks), list(row.publish_blocks),
                                 lora_namespace(row.lora), row.copy_from)
            else:
                self.kv.drop_step(list(row.prefix_blocks), list(row.publish_blocks), row.copy_from)
            if row.state_saves:
                self.kv.end_saves(row.token_ids[: row.shared_len], row.state_saves, ok, lora_namespace(row.lora))
            if row.restore_slot is not None:
                self.kv.release_checkpoint(row.restore_slot)

    def finish(self, request: Request) -> None:
        """The request's life in this engine ends (it finished, was aborted or handed off):
        out of the queues, its blocks freed, its status FINISHED. The scheduler is the one
        writer of `Request.status`; the engine ends a request only through here."""
        if request.exec_class is ExecClass.ONESHOT:
            self.oneshot_admitted.discard(request)
            queues: tuple[list[Request], ...] = (self.oneshot_waiting,)
        else:
            queues = (self.admitted, self.waiting)
        for queue in queues:
            if request in queue:
                queue.remove(request)
        self.kv.free(request.request_id)
        self._parts.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.admitted or self.oneshot_waiting)

    # --- OneShot ----------------------------------------------------------------------

    def activation_bytes(self, req: Request, computed: int) -> int:
        """Rough temporary memory of one OneShot row computing `computed` tokens (the prompt
        past its cached prefix, whose K/V are read in place): a few hidden-size activations
        per token, plus float32 vocab rows when every prompt position needs logprobs."""
        n = computed
        per_token = 16 * self.hidden_size * 4
        if req.params.prompt_logprobs is not None:
            per_token += 2 * self.vocab_size * 4
        return n * per_token

    def _cached_prefix(self, req: Request, tokens: list[int],
                       inside_blocks: bool = False) -> tuple[list[int], CheckpointHit | None]:
        """The cached blocks a request starts after, and (models with recurrent layers)
        the hit with the state checkpoint at their end, which may end inside the next block
        where `inside_blocks` allows it (the row then copies that block's first slots);
        ([], None): none."""
        if self.kv.checkpoints is not None:
            limit = None
            if not reuses_prefix(req):
                if not req.pooled_upto:
                    return [], None
                limit = req.pooled_upto
            hit, agreed = self.kv.state_hit(tokens, namespace(req), inside_blocks and limit is None, limit)
            if limit is not None and (hit is None or hit.num_tokens != limit):
                req.pooled_upto, req.pooled = 0, None  # its checkpoint was evicted: pool again from the start
                return [], None
            if agreed > (hit.num_tokens if hit is not None else 0):
                self._parts[req.request_id] = agreed  # its first row keeps a checkpoint where it parts
            return (hit.blocks, hit) if hit is not None else ([], None)
        if reuses_prefix(req):
            return self.kv.match(tokens, namespace(req)), None
        if req.pooled_upto:  # a running pool goes on after the blocks its chunks published
            found = self.kv.match(tokens, namespace(req))[: req.pooled_upto // self.kv.block_size]
            if len(found) * self.kv.block_size == req.pooled_upto:
                return found, None
            req.pooled_upto, req.pooled = 0, None  # some were evicted: pool again from the start
        return [], None

    def _adapter_fits(self, req: Request, result: ScheduleResult) -> bool:
        """Whether the request's adapter fits the step: a step holds at most `max_loras`
        distinct adapters (the executor's resident slots); the base always fits."""
        if req.lora is None or req.lora.id in result.adapters:
            return True
        if len(result.adapters) >= self.config.max_loras:
            return False
        result.adapters.add(req.lora.id)
        return True

    # --- low-priority requests --------------------------------------------------------

    def _low_priority_allowance(self, now: float) -> int | None:
        """Prompt tokens low-priority rows may take this step (None: no bound); see the
        module doc."""
        cap = self.config.low_priority_step_tokens
        normal_prompt = any(not r.low_priority for r in self.oneshot_waiting) or any(
            not r.low_priority for r in self.waiting) or any(
            not r.low_priority and not is_decoding(r) for r in self.admitted)
        normal_running = normal_prompt or any(not r.low_priority for r in self.admitted)
        if normal_running:
            self._normal_at = now
        if cap is None:
            return None
        if normal_prompt or 0 <= now - self._normal_step_end < self.config.normal_return_s:
            return 0
        if normal_running or now - self._normal_at < self.config.normal_linger_s:
            return cap
        return None

    def _low_priority_tokens(self, req: Request, n: int, alone: bool) -> int:
        """The tokens (<= n) a request may compute under this step's low-priority bound; 0:
        none now. `alone`: a row that can not be split (OneShot) over the bound may go
        when no low-priority row took from the bound yet and no normal prompt waits (else
        a long shared prefix would never run while normal traffic goes on)."""
        left = self._low_priority_left
        if not req.low_priority or left is None or n <= left:
            return n
        if alone and left > 0 and left == self._low_priority_cap:
            return n
        return 0 if alone else max(left, 0)

    def _took_low_priority(self, req: Request, n: int) -> None:
        if req.low_priority and self._low_priority_left is not None:
            self._low_priority_left -= n

    @staticmethod
    def _normal_first(requests: list[Request]) -> list[Request]:
        """A stable reorder: normal requests before low-priority ones."""
        if not any(r.low_priority for r in requests):
            return requests
        return [r for r in requests if not r.low_priority] + [r for r in requests if r.low_priority]

    def _defer(self, req: Request, key: tuple[object, ...] | None, leaders: set[tuple[object, ...]]) -> bool:
        """Cold-prefix leader deferral: a request whose next uncached block is being
        computed by a request already in this step waits (bounded) and then hits."""
        if key is None or not self.config.prefix_deferral:
            return False
        if key in leaders and req.deferred_steps < MAX_DEFER_STEPS:
            req.deferred_steps += 1
            self.kv.stats.deferred += 1
            return True
        leaders.add(key)
        return False

    def _take_oneshot(
        self, now: float, budget: int, memory: int, first_goes: bool, result: ScheduleResult,
    ) -> tuple[list[OneShotRow], list[Request]]:
        """OneShot rows of one head group within `budget` prompt tokens and `memory`
        activation bytes, in policy order; `first_goes`: the first request goes even
        alone over budget (the turn that guarantees OneShot work progresses)."""
        ordered = self._normal_first(self.policy.prefill.order(
            [r for r in self.oneshot_waiting if r.request_id not in self._chunking], now, lambda r: r.num_prompt_tokens))
        if not ordered:
            return [], []
        group = oneshot_group(ordered[0])
        bs = self.kv.block_size
        rows: list[OneShotRow] = []
        taken: list[Request] = []
        leaders: set[tuple[object, ...]] = set()
        riders_of: dict[tuple[object, ...], OneShotLeader] = {}  # first uncached key -> its leader row
        # Models with recurrent layers (state checkpoints): no riders (a rider would need the
        # leader's state at their parting point within the same forward); a leader instead
        # keeps a checkpoint where each deferred peer parts from it (see _checkpoint_rows).
        state = self.kv.checkpoints is not None
        peers_of: dict[tuple[object, ...], list[list[int]]] = {}  # a leader's key -> its deferred peers
        state_rows: list[tuple[int, list[int], int, int, int, tuple[object, ...] | None]] = []
        for req in ordered:
            if oneshot_group(req) != group:
                continue
            prompt = req.prompt_token_ids
            shareable = shareable_tokens(req)
            agreed = 0
            if state and reuses_prefix(req):  # the hit may end inside a block (its row copies that block)
                hit, agreed = self.kv.state_hit(shareable, namespace(req), inside_blocks=True)
                prefix = hit.blocks if hit is not None else []
            else:
                prefix, hit = self._cached_prefix(req, shareable)
                self._parts.pop(req.request_id, None)
            key = self.kv.first_uncached_key(shareable, len(prefix), namespace(req))
            # a peer of a leader in this step rides: the leader's blocks join its prefix
            leader = riders_of.get(key) if key is not None and reuses_prefix(req) and not state else None
            riding = leader.shared_blocks(shareable, bs) if leader is not None else ()
            prefix = prefix + list(riding)
            publish = len(shareable) // bs - len(prefix) if self.kv.prefix is not None else 0
            n_cached = hit.num_tokens if hit is not None else len(prefix) * bs
            n = req.num_prompt_tokens - n_cached
            mem = self.activation_bytes(req, n)
            if self._low_priority_tokens(req, n, alone=first_goes and not taken) < n:
                continue  # low-priority work over this step's bound waits; normal rows may still fit
            if n > budget and not riding and self._chunkable(req) and self._adapter_fits(req, result):
                if hit is not None and hit.copy_from is not None:  # chunks start at a block boundary
                    hit, _ = self.kv.state_hit(shareable, namespace(req))
                    prefix = hit.blocks if hit is not None else []
                chunk = self._chunk_row(req, prefix, budget, hit)
                if chunk is not None:
                    computed = len(chunk.token_ids) - chunk.num_cached
                    rows.append(chunk)
                    result.chunked.append(req)
                    self._chunking.add(req.request_id)
                    self._took_low_priority(req, computed)
                    budget -= computed
                    memory -= self.activation_bytes(req, computed)
                    continue
            if (taken or not first_goes) and (n > budget or mem > memory):
                break
            if not riding and self._defer(req, key, leaders):
                if state and key is not None:
                    peers_of.setdefault(key, []).append(shareable)
                continue
            if not self._adapter_fits(req, result):
                continue
            if state:
                # a hit inside a block needs this row's own copy of that block, published or not
                want = hit.copy_from if hit is not None else None
                publish_blocks, copy_from = self.kv.hold_for_step(prefix, max(publish, int(want is not None)), want)
                if want is not None and copy_from is None:  # no block to copy into: computed whole
                    self.kv.drop_step(prefix, publish_blocks)
                    prefix, publish_blocks, hit, n_cached, agreed = [], [], None, 0, 0
                    n = req.num_prompt_tokens
                if hit is not None:
                    self.kv.hold_checkpoint(hit.slot)
                published_end = (len(prefix) + len(publish_blocks)) * bs
                state_rows.append((len(rows), shareable, n_cached, published_end, agreed, key))
            else:
                # A hit after a shared block may go on inside the next block when this row
                # publishes it (its copy of that block takes the cached slots): a rubric or a chat
                # template ending mid-block. Looked up for taken rows only (a scan of cached
                # children), after the budget, which the full-block hit already bounds.
                partial = (self.kv.match_partial(shareable, prefix, namespace(req))
                           if publish and prefix and reuses_prefix(req) and not riding else None)
                publish_blocks, copy_from = self.kv.hold_for_step(prefix, publish, partial[0] if partial else None)
                if riding:
                    self.kv.stats.riders += 1
                elif (key is not None and publish_blocks and copy_from is None and self.config.prefix_riders
                      and self.config.prefix_deferral):
                    riders_of.setdefault(key, OneShotLeader(shareable, n_cached // bs, tuple(publish_blocks)))
                if partial and copy_from is not None:
                    n_cached, n = n_cached + partial[1], n - partial[1]
            self.kv.record(n_cached, n)
            req.num_cached_tokens = n_cached
            rows.append(OneShotRow(
                req.request_id, prompt, sample_spec(req), head_spec(req),
                num_cached=n_cached, prefix_blocks=tuple(prefix), publish_blocks=tuple(publish_blocks),
                item_lens=req.pooling.item_lens if req.pooling is not None else (), lora=req.lora,
                copy_from=copy_from, restore_slot=hit.slot if state and hit is not None else None,
            ))
            taken.append(req)
            self._took_low_priority(req, n)
            budget -= n
            memory -= mem
        if state_rows:
            self._checkpoint_rows(rows, state_rows, peers_of)
        for req in taken:
            self.oneshot_waiting.remove(req)
            self.oneshot_admitted.add(req)
            req.status = RequestStatus.RUNNING
            req.scheduled_time = req.scheduled_time or now
        return rows, taken

    def _checkpoint_rows(self, rows: list[OneShotRow],
                         state_rows: list[tuple[int, list[int], int, int, int, tuple[object, ...] | None]],
                         peers_of: dict[tuple[object, ...], list[list[int]]]) -> None:
        """The state checkpoints the step's OneShot rows write out of their scratch state:
        on the stride within the blocks they publish; where a deferred peer's prompt parts
        from a leader's (the peer's hit next step is then token-exact, as a dense model's,
        also short of a block or of the stride); where a row's prompt parts from the cached
        prompts it agrees with beyond its hit (the next such prompt hits there)."""
        for i, shareable, n_cached, published_end, agreed, key in state_rows:
            peers = peers_of.get(key, []) if key is not None else []
            parts = {min(common_prefix(shareable, peer), len(peer) - 1) for peer in peers[:8]}
            if agreed > n_cached:
                parts.add(agreed)
            # a checkpoint needs a cached node holding its last token: a block this row
            # publishes, or one its prompt agrees with
            positions = [p for p in self.kv.checkpoint_positions(n_cached, len(shareable), tuple(parts))
                         if p <= max(published_end, agreed)]
            if positions:
                rows[i] = replace(rows[i], state_saves=self.kv.save_slots(positions))

    def _chunkable(self, req: Request) -> bool:
        """A OneShot prompt longer than a step may run in chunks where its head reads its
        last position only (last-token pooling, classify/reward heads, label scores of a prompt
        without items): each chunk publishes its blocks to the prefix cache, and the rest
        of the prompt goes on from there, as any request that hits the cache. Mean and max
        pooling too: each chunk adds its rows to a running pool."""
        return (self.kv.prefix is not None and (reuses_prefix(req) or pools_running(req))
                and req.params.prompt_logprobs is None and not (req.pooling is not None and req.pooling.item_lens))

    def _chunk_row(self, req: Request, prefix: list[int], budget: int,
                   hit: CheckpointHit | None = None) -> OneShotRow | None:
        """A row computing the next whole blocks of `req`'s prompt after its cached `prefix`
        within `budget` tokens, publishing them, with no head; None where no whole block fits
        or the pool has no room for them (the prompt then runs whole, alone)."""
        bs = self.kv.block_size
        blocks = min(budget // bs, (req.num_prompt_tokens - 1) // bs - len(prefix))
        if blocks < 1:
            return None
        publish, _ = self.kv.hold_for_step(prefix, blocks)
        if not publish:
            self.kv.drop_step(prefix, [])
            return None
        n_cached = len(prefix) * bs
        end = n_cached + len(publish) * bs
        self.kv.record(n_cached, end - n_cached)
        head = head_spec(req, chunk=True) if pools_running(req) else None
        restore, saves = None, ()
        if self.kv.checkpoints is not None:  # the next chunk goes on from the state at this one's end
            if hit is not None:
                self.kv.hold_checkpoint(hit.slot)
                restore = hit.slot
            saves = self.kv.save_slots(self.kv.checkpoint_positions(n_cached, end, (end,)))
        return OneShotRow(req.request_id, req.prompt_token_ids[:end], None, head, num_cached=n_cached,
                          prefix_blocks=tuple(prefix), publish_blocks=tuple(publish), lora=req.lora,
                          restore_slot=restore, state_saves=saves)

    def _oneshot_budget(self) -> int:
        return self.config.max_oneshot_tokens or self.config.max_num_batched_tokens

    def _oneshot_step_full(self) -> bool:
        """Whether the waiting OneShot prompts already fill a step's token budget (then more
        arrivals could not join it: gathering them would only delay it). A prompt counts
        past the prefix it shares with the one before it (a peer rides on its leader's)."""
        budget, total, before = self._oneshot_budget(), 0, None
        for req in self.oneshot_waiting:
            prompt = req.prompt_token_ids
            total += len(prompt) - (common_prefix(prompt, before) if before is not None else 0)
            if total >= budget:
                return True
            before = prompt
        return False

    def _schedule_oneshot(self, now: float) -> ScheduleResult:
        result = ScheduleResult(batch=None)
        rows, taken = self._take_oneshot(now, self._oneshot_budget(), self.config.oneshot_activation_bytes, True,
                                         result)
        if not rows:  # every candidate deferred: let the next step run them
            return result
        result.batch, result.oneshot = OneShotBatch(tuple(rows)), taken
        return result

    # --- Decode / Mixed ---------------------------------------------------------------

    def _row(self, req: Request, n: int) -> BatchRow:
        start = req.num_computed_tokens
        n_prompt = req.num_prompt_tokens
        if start >= n_prompt:  # decode (or recompute) past the prompt: read outputs only
            tokens = req.output_token_ids[start - n_prompt : start - n_prompt + n]
        elif start + n <= n_prompt:
            tokens = req.prompt_token_ids[start : start + n]
        else:
            tokens = req.all_token_ids[start : start + n]
        finishes = start + n == req.num_tokens
        # A head reads the prompt's last hidden state, or every prompt row when it
        # needs them all (then the row holds the whole prompt, see _tokens_for).
        covers = start + n >= n_prompt and (start == 0 or reuses_prefix(req))
        head = head_spec(req) if covers else None
        return BatchRow(
            req.request_id, tokens, start, list(self.kv.block_table(req.request_id)),
            sample_spec(req) if finishes else None, head, req.lora, self.kv.state_slot(req.request_id),
            **self._state_checkpoints(req, start, n),
        )

    def _state_checkpoints(self, req: Request, start: int, n: int) -> dict[str, Any]:
        """A paged row's state checkpoints (models with recurrent layers): the one its
        first row restores, those it writes (pending slots) on the stride and where its
        prompt parts from the cached ones, and the block a hit inside a block copies."""
        if self.kv.checkpoints is None:
            return {}
        part = self._parts.pop(req.request_id, None)
        saves = self.kv.save_slots(self.kv.checkpoint_positions(start, start + n, () if part is None else (part,)))
        return {"restore_slot": self.kv.restore_slot(req.request_id), "state_saves": saves,
                "copy_from": self.kv.copy_source(req.request_id)}

    def _tokens_for(self, req: Request, budget: int, first: bool) -> int:
        """Tokens this request computes now; 0 if it must wait for a bigger budget."""
        need = req.num_tokens - req.num_computed_tokens
        needs_all_rows = head_spec(req) is not None and not reuses_prefix(req)
        if needs_all_rows and req.num_computed_tokens == 0 and need > budget:
            # Head rows need the whole prompt in one forward: run alone if it is huge.
            return need if first else 0
        return min(need, budget)

    def _preempt(self, victim: Request, result: ScheduleResult) -> None:
        self.admitted.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.waiting.append(victim)
        result.preempted.append(victim)

    def _allocate_or_preempt(self, req: Request, total: int, victims: list[Request], result: ScheduleResult) -> bool:
        """Room for `total` tokens of a running request, preempting from the end of
        `victims` (lowest priority first, none of them scheduled yet this step).
        False if `req` itself had to go."""
        while not self.kv.allocate(req.request_id, total):
            victim = victims.pop() if victims else req
            self._preempt(victim, result)
            if victim is req:
                return False
        return True

    def _allocate_carried(self, req: Request, victims: list[Request], result: ScheduleResult) -> bool:
        """Room for a carried row (the carried token plus this one), preempting
        only requests not in flight; False (it waits a step) when none is left to go."""
        while not self.kv.allocate(req.request_id, req.num_tokens + 1):
            if not victims:
                return False
            self._preempt(victims.pop(), result)
        return True

    def _remaining(self) -> Callable[[Request], int]:
        """Prompt tokens a request still has to compute, net of its cached prefix (memoized
        for one step: the policy may ask several times)."""
        memo: dict[str, int] = {}

        def remaining(req: Request) -> int:
            if req.request_id not in memo:
                cached = 0
                if req.num_computed_tokens == 0 and reuses_prefix(req):
                    cached = len(self.kv.match(req.all_token_ids, namespace(req))) * self.kv.block_size
                memo[req.request_id] = req.num_tokens - req.num_computed_tokens - cached
            return memo[req.request_id]

        return remaining

    def schedule(
        self, now: float | None = None,
        in_flight: Mapping[str, int] | None = None, sampling: frozenset[str] = frozenset(),
    ) -> ScheduleResult:
        """The next step's batch.

        `in_flight` (decode overlap): the paged requests of the step in flight -> the tokens
        it computes; `sampling`: those whose row there samples. Such a request that
        `can_carry` gets a carried row now, its next decode row one position further, its
        input the carried token (`ScheduleResult.carried`); the others in flight wait a step. Every
        other request is scheduled as usual, and no request in flight is preempted."""
        now = time.monotonic() if now is None else now
        self.kv.trim()  # the cache's bound holds for every lookup this step makes
        self._low_priority_left = self._low_priority_cap = self._low_priority_allowance(now)
        self._in_flight = in_flight or {}
        try:
            result = self._schedule(now, sampling)
        finally:
            self._in_flight = {}
        result.has_normal = any(not r.low_priority for r in result.oneshot) or any(
            not r.low_priority for r in self.admitted if r.request_id in result.scheduled)
        return result

    def _schedule(self, now: float, sampling: frozenset[str]) -> ScheduleResult:
        in_flight = self._in_flight
        decode_work = bool(self.waiting or self.admitted)
        fuse = self.config.fuse_oneshot and decode_work and bool(self.oneshot_waiting)
        if not fuse and self.oneshot_waiting and not (decode_work and self._last_was_oneshot):
            hold_s = 0.0 if decode_work or self._oneshot_step_full() else \
                self.gather.hold(self.oneshot_waiting, now, self._oneshot_budget())
            if hold_s > 0:
                return ScheduleResult(batch=None, hold_s=hold_s)  # the rest of the burst is on its way
            self._last_was_oneshot = True
            return self._schedule_oneshot(now)
        self._last_was_oneshot = False
        result = ScheduleResult(batch=None)
        budget = self.config.max_num_batched_tokens
        rows: list[BatchRow] = []
        oneshot_rows: list[OneShotRow] = []

        # 1. Decode slots, in the decode policy's order (the rest keep their KV and wait).
        # Requests in flight get a carried row or wait; they are never preempted (their step
        # still writes their blocks).
        max_len = self.config.max_model_len or 0
        carry = {r.request_id for r in self.admitted if r.request_id in in_flight and r.request_id in sampling
                 and (not max_len or can_carry(r, max_len))}
        decoding = [r for r in self.admitted if (r.request_id not in in_flight and is_decoding(r)) or r.request_id in carry]
        prefilling = [r for r in self.admitted if r.request_id not in in_flight and not is_decoding(r)]
        order = self.policy.decode.order(decoding, now)
        slots = self.config.max_decode_batch or len(order)
        victims = by_arrival(prefilling) + [r for r in order if r.request_id not in in_flight]
        served: list[Request] = []
        preempted = len(result.preempted)
        while order and budget > 0 and len(served) < slots:
            req = order.pop(0)
            if not self._adapter_fits(req, result):
                continue  # its adapter waits for a step with a free slot (it keeps its KV)
            if req.request_id in carry:  # a carried row: its next row, after the carried token
                if not self._allocate_carried(req, victims, result):
                    order = [r for r in order if r.status is RequestStatus.RUNNING]
                    continue
                rows.append(BatchRow(req.request_id, [CARRIED_TOKEN_PLACEHOLDER], req.num_tokens,
                                     list(self.kv.block_table(req.request_id)), sample_spec(req, carried=1),
                                     None, req.lora, self.kv.state_slot(req.request_id),
                                     **self._state_checkpoints(req, req.num_tokens, 1)))
                result.carried.append(req.request_id)
            else:
                victims.remove(req)
                ok = self._allocate_or_preempt(req, req.num_tokens, victims, result)
                if not ok:
                    order = [r for r in order if r.status is RequestStatus.RUNNING]  # drop the preempted
                    continue
                rows.append(self._row(req, 1))
            if len(result.preempted) != preempted:  # drop the preempted (rebuilt only then: O(rows) each)
                preempted = len(result.preempted)
                order = [r for r in order if r.status is RequestStatus.RUNNING]
            result.scheduled[req.request_id] = 1
            served.append(req)
            budget -= 1
        served_set, admitted_set = set(served), set(self.admitted)  # Requests hash by identity
        self.policy.decode.on_step(served, [r for r in decoding if r not in served_set and r in admitted_set], now)

        # 2. Prompt work (in-progress chunks and waiting prompts), in the prefill policy's
        # order; in a fused step, OneShot prompts share what the decodes left, taking turns
        # with the paged prompts at going first (the one first may go alone over budget).
        if fuse:
            oneshot_first, self._oneshot_turn = self._oneshot_turn, not self._oneshot_turn
            if oneshot_first:
                budget -= self._fuse_oneshot(now, budget, oneshot_rows, result, first_goes=True)
        if not result.preempted:
            budget -= self._schedule_prefills(now, max(budget, 0), rows, result)
        if fuse and not oneshot_first:
            self._fuse_oneshot(now, budget, oneshot_rows, result, first_goes=False)

        if rows:
            decode: list[BatchRow] = []
            prefill: list[BatchRow] = []
            for r in rows:
                is_decode = r.sample is not None and len(r.token_ids) == 1 and r.start_pos > 0
                (decode if is_decode else prefill).append(r)
            if prefill or oneshot_rows:
                result.batch = MixedBatch(tuple(prefill), tuple(decode), tuple(oneshot_rows))
            else:
                result.batch = DecodeBatch(tuple(decode))
        elif oneshot_rows:
            result.batch = OneShotBatch(tuple(oneshot_rows))
        return result

    def _fuse_oneshot(
        self, now: float, budget: int, rows: list[OneShotRow], result: ScheduleResult, first_goes: bool
    ) -> int:
        """OneShot rows for a fused step within the step's remaining token budget (and the
        OneShot budgets); returns the prompt tokens they compute."""
        if not self.oneshot_waiting or (budget <= 0 and not first_goes):
            return 0
        taken_rows, taken = self._take_oneshot(
            now, min(max(budget, 0), self._oneshot_budget()), self.config.oneshot_activation_bytes, first_goes, result)
        rows.extend(taken_rows)
        result.oneshot.extend(taken)
        return sum(len(r.token_ids) - r.num_cached for r in taken_rows)

    def _schedule_prefills(self, now: float, budget: int, rows: list[BatchRow], result: ScheduleResult) -> int:
        """Prompt rows within `budget`, appended to `rows`; returns the tokens they take."""
        in_progress = [r for r in self.admitted if not is_decoding(r) and r.request_id not in self._in_flight]
        candidates = in_progress + self.waiting
        if not candidates:
            return 0
        start_budget = budget
        remaining = self._remaining()
        plan = self.policy.prefill.plan(candidates, now, remaining, budget)
        if any(c.request.low_priority for c in plan):  # normal requests first, each in policy order
            plan = [c for c in plan if not c.request.low_priority] + [c for c in plan if c.request.low_priority]
        leaders: set[tuple[object, ...]] = set()
        later_running = [c.request for c in plan if c.request.status is RequestStatus.RUNNING]
        for choice in plan:
            req = choice.request
            if budget <= 0:
                break
            if not self._adapter_fits(req, result):
                continue
            if req.status is RequestStatus.RUNNING:  # an in-progress prompt: its next chunk
                later_running.remove(req)
                n = min(req.num_tokens - req.num_computed_tokens, budget, choice.max_tokens or budget)
                n = self._low_priority_tokens(req, n, alone=False)
                if n == 0:
                    continue
                if not self._allocate_or_preempt(req, req.num_computed_tokens + n, later_running, result):
                    continue
            else:
                if len(self.admitted) >= self.config.max_num_seqs:
                    continue
                cap = choice.max_tokens
                if req.low_priority and self._low_priority_left is not None:
                    if self._low_priority_left <= 0:
                        continue
                    cap = min(cap or budget, self._low_priority_left)
                n = self._admit(req, budget, cap, leaders, first=not rows)
                if n is None:
                    continue
                if n == 0:
                    break  # the KV pool is full: later prompts would not fit either
            rows.append(self._row(req, n))
            result.scheduled[req.request_id] = n
            self._took_low_priority(req, n)
            budget -= n
        return start_budget - budget

    def _admit(
        self, req: Request, budget: int, cap: int | None, leaders: set[tuple[object, ...]], first: bool
    ) -> int | None:
        """Admit a waiting request: attach its cached prefix and allocate its first chunk.
        Returns the chunk size, None to skip it this step, 0 when the pool is full."""
        tokens = req.all_token_ids
        prefix, hit = (self._cached_prefix(req, tokens, inside_blocks=True) if req.num_computed_tokens == 0
                       else ([], None))
        if self._defer(req, self.kv.first_uncached_key(tokens, len(prefix), namespace(req)), leaders):
            self._parts.pop(req.request_id, None)
            return None
        attached = hit is not None or bool(prefix)
        if attached:
            self.kv.attach(req.request_id, prefix, hit.slot if hit is not None else None,
                           hit.copy_from if hit is not None else None)
            req.num_computed_tokens = hit.num_tokens if hit is not None else len(prefix) * self.kv.block_size
        n_cached = req.num_computed_tokens
        n = self._tokens_for(req, min(budget, cap or budget), first)
        # the watermark spares running decodes a preemption: with none running it would only
        # keep a pool of up to 100 blocks from ever admitting a request that needs all of it
        reserve = self.watermark_blocks if self.admitted else 0
        if n == 0 or not self.kv.allocate(req.request_id, req.num_computed_tokens + n, reserve=reserve):
            self._parts.pop(req.request_id, None)
            if attached:  # not admitted after all: let go of the attached prefix
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
            return None if n == 0 else 0
        if req.num_preemptions == 0:
            self.kv.record(n_cached, req.num_prompt_tokens - n_cached)
        self.waiting.remove(req)
        self.admitted.append(req)
        req.status = RequestStatus.RUNNING
        req.scheduled_time = req.scheduled_time or time.monotonic()
        return n

    def observe_step(self, batch: ForwardBatch, seconds: float) -> None:
        """Measured duration of a step: OneShot gathering bounds its holds by it, policies
        that model prompt work fit it."""
        if isinstance(batch, OneShotBatch) or (isinstance(batch, MixedBatch) and batch.oneshot_rows):
            rows = batch.rows if isinstance(batch, OneShotBatch) else batch.oneshot_rows
            self.gather.observe(seconds, sum(len(r.token_ids) - r.num_cached for r in rows))
        if isinstance(batch, MixedBatch) and batch.prefill_rows:
            prompts = [(len(r.token_ids), r.start_pos) for r in batch.prefill_rows]
            prompts += [(len(r.token_ids) - r.num_cached, r.num_cached) for r in batch.oneshot_rows]  # fused
            self.policy.prefill.observe_step(prompts, seconds)
