"""The engine: one visible step loop, schedule -> execute -> postprocess.

`LLMEngine` is synchronous and single-threaded; the async front (async_engine.py)
drives it from one background thread for the HTTP server, the offline API calls
`step()` directly.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from prelude.config import EngineConfig
from prelude.engine.client import InvalidRequestError
from prelude.engine.validation import RequestRules, validate_request
from prelude.engine.grammar import GrammarCompiler
from prelude.forward_batch import BatchOutput, DecodeBatch, MixedBatch, OneShotBatch
from prelude.engine.errors import StepFailed
from prelude.engine.handoff import KVHandoff, resumable_copy
from prelude.engine.metrics import EngineObserver, RequestMetrics, batch_kind, request_metrics
from prelude.engine.output_processor import OutputStream, emit, new_stream, oneshot_output, process_token
from prelude.engine.policies import make_policy
from prelude.params import EmbedSetup
from prelude.engine.request import (
    ExecClass,
    FinishReason,
    LoraRequest,
    PoolingParams,
    Request,
    RequestOutput,
    SamplingParams,
)
from prelude.engine.scheduler import ScheduleResult, Scheduler
from prelude.engine.stage_trace import StageTrace
from prelude.executor.kv_sizing import kv_cache_budget
from prelude.executor.outputs import CarriedTokens, LaunchedStep
from prelude.executor.runner import ModelRunner
from prelude.kv.kv_manager import KVCacheManager, blocks_needed
from prelude.tokenizer.base import Tokenizer

logger = logging.getLogger("prelude.engine")
# The start-up line's words for CacheConfig.populate_kv (model/kv_memory.py)
_POPULATED = {"start": "; its pages faulted in at start (no page faults while serving)",
              "background": "; its pages faulted in by a thread beside the rest of start-up"}


@dataclass(frozen=True)
class InFlight:
    """A launched step whose results have not been post-processed yet: the executor's
    handle (`LaunchedStep`, which knows no plan) with the engine's side of the step, the
    plan whose holds and requests it settles. Kept apart so the executor stays below the
    engine."""

    plan: ScheduleResult
    launched: LaunchedStep
    started: float
    traces: tuple[StageTrace, ...] = ()  # of its traced requests (`--trace-stages`)


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        config: EngineConfig,
        model_name: str,
    ) -> None:
        self.config = config
        self.model_name = config.served_model_name or model_name
        self.tokenizer = tokenizer
        self.runner = runner
        runner.limit_sampled_vocab(tokenizer.vocab_size)
        self.info = info = runner.info
        self.block_size = block_size = runner.block_size
        limit = config.scheduler.max_model_len or info.max_position_embeddings
        self.num_state_slots = self.num_checkpoint_slots = 0
        if info.is_encoder:
            num_blocks = 1  # encoders keep no KV: every request is OneShot
            self.max_model_len = min(limit, info.max_position_embeddings)
        else:
            num_blocks, self.num_state_slots, self.num_checkpoint_slots, why = self._kv_blocks(config)
            if info.sliding_window:
                # Full attention equals sliding-window attention only within the window.
                limit = min(limit, info.sliding_window)
            self.max_model_len = min(limit, num_blocks * block_size, info.max_positions)
        # A prefix of a model with recurrent layers is its KV and its state at the prefix's
        # end: such a model caches prefixes only with checkpoint slots for those states.
        prefix_caching = config.cache.enable_prefix_caching and not info.is_encoder and (
            not self.num_state_slots or self.num_checkpoint_slots > 0)
        if config.cache.enable_prefix_caching and self.num_state_slots and not self.num_checkpoint_slots:
            logger.info("prefix caching: off (the model has recurrent layers and --max-state-checkpoints is 0): "
                        "every prompt is computed whole")
        self.kv = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=prefix_caching,
            max_cached_blocks=config.cache.max_cached_blocks, num_state_slots=self.num_state_slots,
            num_checkpoint_slots=self.num_checkpoint_slots if prefix_caching else 0,
            checkpoint_stride=config.cache.state_checkpoint_stride,
        )
        if not prefix_caching:
            self.num_checkpoint_slots = 0
        runner.allocate_kv_cache(num_blocks, populate=config.cache.populate_kv,
                                 state_slots=self.num_state_slots + self.num_checkpoint_slots)
        if not info.is_encoder:
            runner.capture_graphs(self.max_model_len)  # a no-op off CUDA or with enforce_eager
        sched_cfg = replace(config.scheduler, max_model_len=self.max_model_len,
                            max_loras=runner.adapters.slots.num_slots if runner.adapters is not None else 0)
        if runner.graphs is not None:  # LAPS batches toward the shapes that replay
            sched_cfg = replace(sched_cfg, policy_options=replace(
                sched_cfg.policy_options, depth_buckets=runner.graphs.decode_batch_sizes))
        self.scheduler = Scheduler(
            sched_cfg, self.kv, make_policy(sched_cfg.policy, sched_cfg.policy_options), info.vocab_size, info.hidden_size
        )
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(info.eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, info.vocab_size, self.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._streams: dict[str, OutputStream] = {}
        self._ready: list[RequestOutput] = []  # outputs that need no forward (max_tokens=0)
        self._handoffs: list[KVHandoff] = []  # prefilled here, to be decoded elsewhere (take_handoffs)
        self.handoff_counts = {"exported": 0, "imported": 0, "imported_recomputed": 0}
        self._rng = random.Random(config.seed)  # sampling seeds of requests that name none
        self.idle = False
        self.hold_s = 0.0
        # Overlap pays where the device runs asynchronously to the host; on a CPU the host
        # is the device, so there is nothing to hide.
        self.overlap = config.overlap if config.overlap is not None else info.device.startswith("cuda")
        self._in_flight: InFlight | None = None
        # Whether the last step launched had heads that outweigh its trunk, on a CPU (see
        # ModelRunner.heads_outweigh_trunk): the async front then hands streaming outputs
        # over while the next step's heads run.
        self.heads_heavy = False
        self._tracing = False  # set for good by the first traced request: off, steps look for no traces
        # The last 10,000 finished requests' records, as plain tuples: CPython's collector stops
        # tracking a tuple of strs and numbers (not a NamedTuple's), so its full passes skip them.
        self._finished: deque[tuple[object, ...]] = deque(maxlen=10_000)
        self.observer: EngineObserver | None = None  # e.g. the server's Prometheus metrics
        if not info.is_encoder:
            logger.info(
                "KV cache: %d blocks x %d tokens (%.2f GiB) on %s, max_model_len %d; budget: %s%s",
                num_blocks, block_size, num_blocks * info.kv_bytes_per_block / 2**30, info.device, self.max_model_len,
                why, _POPULATED.get(config.cache.populate_kv, "") if info.device == "cpu" else "",
            )
        if self.num_state_slots:
            logger.info(
                "recurrent state: %d slots x %.2f MiB (%.2f GiB) on %s, one per running paged request; OneShot "
                "requests hold none (--max-recurrent-slots caps it)", self.num_state_slots,
                info.state_bytes_per_slot / 2**20, self.num_state_slots * info.state_bytes_per_slot / 2**30,
                info.device)
        if self.num_checkpoint_slots:
            logger.info(
                "prefix caching: on, with %d state checkpoint slots (%.2f GiB) kept every %d tokens and where "
                "peers' prompts part, evicted with their blocks (--max-state-checkpoints, "
                "--state-checkpoint-stride)", self.num_checkpoint_slots,
                self.num_checkpoint_slots * info.state_bytes_per_slot / 2**30, config.cache.state_checkpoint_stride)
        runner.start_background_work()  # e.g. --compile background: off the loading path

    def _kv_blocks(self, config: EngineConfig) -> tuple[int, int, int, str]:
        """How many KV blocks, recurrent-state slots and state checkpoint slots, and why
        (see executor/kv_sizing.py). Slots come out of the same budget: one per running
        sequence (max_num_seqs, capped by max_recurrent_slots), at most half the budget, at
        least one; checkpoints (with prefix caching) a quarter of it unless
        max_state_checkpoints says."""
        per_slot = self.info.state_bytes_per_slot
        wanted = 0
        checkpoints = config.cache.max_state_checkpoints
        if checkpoints is not None and checkpoints < 0:
            raise ValueError("--max-state-checkpoints must be at least 0")
        if not per_slot or not config.cache.enable_prefix_caching:
            checkpoints = 0
        if per_slot:
            wanted = config.scheduler.max_num_seqs
            if config.cache.max_recurrent_slots is not None:
                if config.cache.max_recurrent_slots < 1:
                    raise ValueError("--max-recurrent-slots must be at least 1")
                wanted = min(wanted, config.cache.max_recurrent_slots)
        if config.cache.num_blocks:
            return (config.cache.num_blocks, wanted, 16 if checkpoints is None else checkpoints,
                    "num_blocks set explicitly")
        runner, sched = self.runner, config.scheduler
        memory = None
        if config.cache.kv_cache_memory_gib is None:  # measured only when it decides something
            largest = max(sched.max_num_batched_tokens, sched.max_oneshot_tokens or 0)
            memory = runner.device_memory(largest, sched.max_num_seqs)
        budget = kv_cache_budget(
            memory, kv_cache_memory_gib=config.cache.kv_cache_memory_gib,
            gpu_memory_utilization=config.cache.gpu_memory_utilization,
            resident_bytes=runner.adapters.nbytes if runner.adapters is not None else 0,  # LoRA slots
        )
        slots = min(wanted, max(1, budget.bytes // 2 // per_slot)) if per_slot else 0
        if checkpoints is None:
            checkpoints = max(1, budget.bytes // 4 // per_slot)
        blocks = max(1, (budget.bytes - (slots + checkpoints) * per_slot) // max(1, self.info.kv_bytes_per_block))
        return blocks, slots, checkpoints, budget.reason

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        from prelude.executor.loading import load_runner

        t0 = time.perf_counter()
        loaded = load_runner(config)
        runner = loaded.runner
        engine = cls(runner, loaded.tokenizer, config, loaded.name)
        logger.info("loaded %s (%s on %s) in %.2f s", loaded.name, runner.info.dtype, runner.info.device,
                    time.perf_counter() - t0)
        return engine

    @property
    def request_rules(self) -> RequestRules:
        """What `prepare` (and a scale-out front, through ReplicaInfo) validates against; read
        from the engine's current settings (its eos set may be changed after build)."""
        sched = self.config.scheduler
        return RequestRules(
            max_model_len=self.max_model_len, vocab_size=self.info.vocab_size, eos_token_ids=self.eos_token_ids,
            can_generate=self.can_generate, force_paged=sched.force_paged, labels=self.labels,
            default_pooling=self.info.default_pooling, default_ttft_slo_ms=sched.default_ttft_slo_ms,
            lora_enabled=self.runner.adapters is not None, embed=self.info.embed,
            score_template=self.info.score_template, classify_pad_id=self.info.classify_pad_id,
        )

    @property
    def labels(self) -> tuple[str, ...]:
        """Names of the classification head's outputs (empty without a head)."""
        return self.info.labels

    @property
    def can_generate(self) -> bool:
        return self.info.can_generate

    @property
    def is_encoder(self) -> bool:
        return self.info.is_encoder

    @property
    def embed_setup(self) -> EmbedSetup:
        return self.info.embed

    @property
    def score_template(self) -> str | None:
        return self.info.score_template

    # --- requests -------------------------------------------------------------------

    def prepare(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams | None = None,
        lora: LoraRequest | None = None,
    ) -> Request:
        """Validation: check the request, build the Request and pick its class (raises
        InvalidRequestError). Touches no engine state, so the async front calls it on the
        caller's thread."""
        rules = self.request_rules
        if lora is not None and pooling is not None:  # an adapter may bring its own classification head
            rules = replace(rules, labels=self.labels_for(lora))
        req = validate_request(request_id, prompt_token_ids, params, rules,
                               seed_source=self._rng, pooling=pooling, lora=lora)
        return self.attach_grammar(req)

    def check_adapter(self, lora: LoraRequest) -> tuple[str, ...]:
        """Read a LoRA adapter and check it against the model (raises LoraError, or
        ValueError when this engine has no adapter slots); returns the labels of its own
        classification head (() without one). Any thread: it reads files and touches no
        engine state."""
        if self.runner.adapters is None:
            raise ValueError("this engine runs without LoRA (start it with --max-loras > 0 or --lora-modules)")
        return self.runner.adapters.read(lora).labels

    def labels_for(self, lora: LoraRequest | None) -> tuple[str, ...]:
        """The classification labels a request sees: its adapter's own head's, else the base's."""
        if lora is not None and self.runner.adapters is not None:
            return self.runner.adapters.labels(lora) or self.labels
        return self.labels

    def attach_grammar(self, req: Request) -> Request:
        """Give a constrained generation its matcher (any thread; a malformed constraint
        raises InvalidRequestError). Requests validated by a scale-out front arrive without one:
        a matcher holds native state and never crosses processes."""
        if req.params.structured is not None and req.pooling is None and req.grammar is None:
            req.grammar = self.grammars.matcher(req.params.structured)
        return req

    def enqueue(self, req: Request) -> None:
        """Queue a prepared request (engine thread only)."""
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.hand_off and self.num_state_slots:
            raise InvalidRequestError("prefill/decode disaggregation is not served for this model: the KV hand-off "
                                      "does not carry the recurrent state of its linear-attention layers")
        needs_forward = req.max_output_tokens > 0 or req.pooling is not None or req.params.prompt_logprobs is not None
        if not needs_forward:
            req.finish_reason = FinishReason.LENGTH
            self.scheduler.finish(req)  # never queued: only its status changes
            self._ready.append(emit(req, new_stream(self.tokenizer, req), 0, finished=True))
            return
        self._requests[req.request_id] = req
        if req.trace is not None:
            self._tracing = True
        if req.exec_class is ExecClass.PAGED:  # OneShot requests get no streaming state
            self._streams[req.request_id] = new_stream(self.tokenizer, req)
        self.scheduler.add(req)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams | None = None,
        lora: LoraRequest | None = None,
    ) -> Request:
        req = self.prepare(request_id, prompt_token_ids, params, pooling, lora)
        self.enqueue(req)
        return req

    def abort_all(self) -> list[str]:
        ids = list(self._requests)
        for rid in ids:
            self.abort(rid)
        return ids

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; True if it was still in the engine."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._streams.pop(request_id, None)  # OneShot requests never had one
        self.scheduler.finish(req)
        req.finish_reason = FinishReason.ABORT
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._ready or self._in_flight)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # --- the step loop --------------------------------------------------------------

    def step(self, on_heads: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> postprocess. `on_heads`: called when the
        step's trunk has run and its heads start (ModelRunner.launch; not called when the
        step launches nothing).

        Overlap is a choice (`EngineConfig.overlap`, on with CUDA): `launch` returns while
        the device computes, and the step stays in flight into the next iteration. That
        iteration schedules the next step before the one in flight has been read: its
        carried rows, decode rows one position further whose inputs are the carried tokens
        (sampled by the step in flight, copied on the device: `plan.carried`); new prompts and OneShot rows as
        usual. Only then is the step in flight post-processed, so a stop string, a stop
        token or an abort is seen one step late and the carried row is dropped.
        Rows that need the token on the host first (a grammar's mask, penalties) wait."""
        outputs, self._ready = self._ready, []
        failed: list[str] = []
        cause: BaseException | None = None
        in_flight, self._in_flight = self._in_flight, None
        scheduling = time.perf_counter() if self._tracing else 0.0
        plan = self._schedule(in_flight)
        traces = self._traces(plan, scheduling) if self._tracing else ()
        launched = None
        if plan.batch is not None:
            carried = CarriedTokens(in_flight.launched, tuple(plan.carried)) if plan.carried and in_flight else None
            try:
                # The clock starts before the launch: on a CPU `launch` runs the whole forward.
                started = time.perf_counter()
                queued = self.runner.launch(plan.batch, carried, on_heads)
                launched = InFlight(plan, queued, started, traces)
                self.heads_heavy = queued.heads_heavy and not self.overlap
            except Exception as exc:  # noqa: BLE001 - contained: only this step's requests fail
                failed, cause = failed + self._fail_step(plan), exc
        for step in (in_flight, None if self.overlap else launched):
            if step is None:
                continue
            try:
                result = step.launched.wait()
            except Exception as exc:  # noqa: BLE001 - the forward raised when its result was awaited
                failed, cause = failed + self._fail_step(step.plan), exc
                continue
            for trace in step.traces:
                trace.mark("forward", step.launched.forward_done)
                trace.mark("sample")
            outputs.extend(self._postprocess(step, result))
            for trace in step.traces:
                trace.mark("detokenize")
        if launched is not None and self.overlap:
            self._in_flight = launched
        self.idle = plan.batch is None and in_flight is None  # work may be held back on purpose
        self.hold_s = plan.hold_s if self.idle else 0.0  # a OneShot gather's hold: how long at most
        if cause is not None:
            self._ready = outputs  # the other step's outputs go out with the next step
            raise StepFailed(failed, cause)
        return outputs

    def _schedule(self, in_flight: InFlight | None) -> ScheduleResult:
        """The next plan; with a step in flight, scheduled around it (see `step`)."""
        if in_flight is None:
            return self.scheduler.schedule()
        batch = in_flight.plan.batch
        paged = batch.rows if isinstance(batch, (DecodeBatch, MixedBatch)) else ()
        sampling = frozenset(r.request_id for r in paged if r.sample is not None)
        return self.scheduler.schedule(in_flight=in_flight.plan.scheduled, sampling=sampling)

    def _traces(self, plan: ScheduleResult, scheduling: float) -> tuple[StageTrace, ...]:
        """Mark the wait and the schedule on the plan's traced requests; their traces."""
        reqs = [*plan.oneshot, *(self._requests.get(rid) for rid in plan.scheduled)]
        traces = tuple(req.trace for req in reqs if req is not None and req.trace is not None)
        scheduled = time.perf_counter()
        for trace in traces:
            trace.mark("wait_for_step", scheduling)
            trace.mark("schedule", scheduled)
        return traces

    def _fail_step(self, plan: ScheduleResult) -> list[str]:
        """Release everything a failed step held and drop its requests; their ids."""
        self.scheduler.end_step(plan, ok=False)
        failed = [req.request_id for req in plan.oneshot + plan.chunked if self._requests.get(req.request_id) is req]
        failed += [rid for rid in plan.scheduled if rid in self._requests]
        for rid in failed:
            self.abort(rid)
        return failed

    def _postprocess(self, step: InFlight, result: BatchOutput) -> list[RequestOutput]:
        plan = step.plan
        assert plan.batch is not None
        seconds = time.perf_counter() - step.started
        self.scheduler.observe_step(plan.batch, seconds)
        if self.observer is not None:
            kind, num_tokens = batch_kind(plan.batch)
            self.observer.step_finished(kind, seconds, num_tokens)
        self.scheduler.end_step(plan, ok=True)  # computed counts advance, blocks published, holds end
        now = time.monotonic()
        outputs = [] if isinstance(plan.batch, OneShotBatch) else self._postprocess_paged(plan, result, now)
        if plan.oneshot_rows:  # a OneShot step, or the OneShot rows of a fused step
            outputs += self._postprocess_oneshot(plan.oneshot, result, now)
        if plan.chunked:  # chunks of prompts longer than a step: a running pool goes on
            ends = {row.request_id: len(row.token_ids) for row in plan.oneshot_rows}
            for req in plan.chunked:
                head = result.heads.get(req.request_id)
                if head is not None and head.pooled is not None:
                    req.pooled, req.pooled_upto = tuple(head.pooled), ends[req.request_id]
        return outputs

    def _postprocess_oneshot(self, requests: list[Request], result: BatchOutput, now: float) -> list[RequestOutput]:
        """One final output per request (the step's block holds ended in `end_step`)."""
        outputs = []
        for req in requests:
            if self._requests.get(req.request_id) is not req:
                continue  # aborted while its step was in flight
            req.first_token_time = req.finish_time = now
            sampled = result.sampled.get(req.request_id)
            outputs.append(oneshot_output(
                req, self.tokenizer,
                sampled.token_id if sampled else None, sampled.logprob if sampled else None,
                result.heads.get(req.request_id),
            ))
            self.scheduler.finish(req)
            del self._requests[req.request_id]
            self._record_finished(req)
        return outputs

    def _postprocess_paged(self, plan: ScheduleResult, result: BatchOutput, now: float) -> list[RequestOutput]:
        """Append sampled tokens and deliver heads (`end_step` advanced the computed counts)."""
        outputs = []
        for request_id in plan.scheduled:
            req = self._requests.get(request_id)
            if req is None:
                continue  # aborted while its step was in flight
            stream = self._streams[request_id]
            head = result.heads.get(request_id)
            if head is not None:
                req.head_done = True
                stream.pending_head = head
            sampled = result.sampled.get(request_id)
            if sampled is not None:
                if req.first_token_time is None:
                    req.first_token_time = now
                if req.grammar is not None:
                    req.grammar.accept(sampled.token_id)
                out = process_token(req, stream, sampled.token_id, sampled.logprob, self.max_model_len)
            elif head is not None and req.max_output_tokens == 0:
                req.finish_reason = FinishReason.LENGTH  # a head-only request on the Paged path
                out = emit(req, stream, 0, finished=True)
            else:
                continue
            if out.finished:
                self._finish(req)
            elif req.hand_off and sampled is not None:
                self._hand_off(req)
            outputs.append(out)
        return outputs

    # --- KV hand-off (prefill/decode disaggregation, see handoff.py) ------------------

    def _hand_off(self, req: Request) -> None:
        """The first token is out: copy the request's KV blocks out and end its life here.
        Its blocks go back through the normal path (full prompt blocks were published to
        the prefix cache as they filled, so they stay hit-able here)."""
        blocks = self.scheduler.computed_blocks(req)
        self._handoffs.append(KVHandoff(
            resumable_copy(req), req.num_computed_tokens, self.block_size, self.runner.read_kv_blocks(blocks),
            exported_at=time.monotonic()))
        self.handoff_counts["exported"] += 1
        self.scheduler.finish(req)  # not recorded here: the decode engine records the whole request
        del self._requests[req.request_id]
        del self._streams[req.request_id]

    def take_handoffs(self) -> list[KVHandoff]:
        """Requests prefilled by the last steps, ready for a decode engine (each one's
        first-token output was among the steps' outputs)."""
        out, self._handoffs = self._handoffs, []
        return out

    def import_kv(self, handoff: KVHandoff) -> None:
        """Continue a request another engine prefilled (engine thread only): allocate
        blocks, copy its KV in and run it as a decode whose stream continues after the
        first token. With no room in the pool it falls back to recomputing its prompt
        here, as a preempted request would."""
        req = resumable_copy(handoff.request)
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if handoff.block_size != self.block_size or len(req.output_token_ids) != 1 \
                or handoff.num_computed_tokens != req.num_prompt_tokens \
                or handoff.num_blocks != blocks_needed(handoff.num_computed_tokens, self.block_size):
            raise ValueError(f"hand-off of {rid!r} does not fit this engine (block size {handoff.block_size}, "
                             f"{handoff.num_computed_tokens} tokens in {handoff.num_blocks} blocks)")
        if self.attach_grammar(req).grammar is not None:
            req.grammar.accept(handoff.first_token)
        # Replay the first token into a fresh stream: its text state becomes the prefill
        # side's after that token, whose increment was sent from there.
        stream = new_stream(self.tokenizer, req)
        req.output_token_ids = []
        replay = process_token(req, stream, handoff.first_token, None, self.max_model_len)
        # Onto this engine's clock (another host's monotonic clock is not comparable): the
        # request's times keep their distance from the hand-off, taken as now. Its latency
        # record, kept here, then has the prefill side's TTFT.
        now = time.monotonic()
        for name in ("arrival_time", "first_token_time", "scheduled_time"):
            then = getattr(req, name)
            setattr(req, name, now if then is None else now - max(0.0, handoff.exported_at - then))
        req.ttft_deadline = None
        self._requests[rid] = req
        self._streams[rid] = stream
        self.handoff_counts["imported"] += 1
        if replay.finished:  # a shorter context here than there: nothing left to decode
            self._finish(req)
            self._ready.append(emit(req, stream, len(stream.text), finished=True))
            return
        try:  # the scheduler allocates, the runner fills the blocks; a failed copy frees them
            adopted = self.scheduler.adopt(req, handoff.num_computed_tokens,
                                           lambda table: self.runner.write_kv_blocks(table, handoff.kv))
        except BaseException:
            del self._requests[rid], self._streams[rid]
            raise
        if not adopted:
            self.handoff_counts["imported_recomputed"] += 1
            self.scheduler.add(req)

    def _finish(self, req: Request) -> None:
        self.scheduler.finish(req)
        req.finish_time = time.monotonic()
        self._record_finished(req)
        del self._requests[req.request_id]
        del self._streams[req.request_id]

    @property
    def finished_metrics(self) -> list[RequestMetrics]:
        """The records of the last 10,000 requests that ran to their end, oldest first."""
        return [RequestMetrics._make(t) for t in self._finished]

    def _record_finished(self, req: Request) -> None:
        record = request_metrics(req)
        self._finished.append(tuple(record))
        if self.observer is not None:
            self.observer.request_finished(record)

    def metrics(self) -> dict[str, float]:
        """Counters for /metrics and logs (read on the engine thread or between steps)."""
        st = self.kv.stats
        return {
            # vLLM's num_requests_running: every request being computed, OneShot rows in flight included
            "requests_running": len(self.scheduler.admitted) + len(self.scheduler.oneshot_admitted),
            "requests_running_paged": len(self.scheduler.admitted),
            "requests_running_oneshot": len(self.scheduler.oneshot_admitted),
            "requests_waiting": len(self.scheduler.waiting) + len(self.scheduler.oneshot_waiting),
            "requests_waiting_paged": len(self.scheduler.waiting),
            "requests_waiting_oneshot": len(self.scheduler.oneshot_waiting),
            "kv_blocks_total": self.kv.pool.num_blocks,
            "kv_blocks_free": self.kv.pool.num_free_blocks,
            "kv_blocks_cached_evictable": self.kv.pool.num_evictable_blocks,
            "recurrent_slots_total": self.num_state_slots,
            "recurrent_slots_free": self.kv.num_free_slots or 0,
            "state_checkpoint_slots_total": self.num_checkpoint_slots,
            "state_checkpoints_cached": self.kv.prefix.num_checkpoints if self.kv.prefix else 0,
            "state_checkpoints_saved_total": st.checkpoints_saved,
            "state_checkpoints_evicted_total": self.kv.checkpoints.num_evicted if self.kv.checkpoints else 0,
            "prefix_cache_blocks": self.kv.prefix.num_cached_blocks if self.kv.prefix else 0,
            "prefix_cache_queries_total": st.queries,
            "prefix_cache_hits_total": st.hits,
            "prefix_reused_tokens_total": st.reused_tokens,
            "prefix_computed_tokens_total": st.computed_tokens,
            "prefix_cache_hit_rate": st.hit_rate,
            "prefix_published_blocks_total": st.published_blocks,
            "prefix_deferred_requests_total": st.deferred,
            "prefix_rider_requests_total": st.riders,
            "prefix_evicted_blocks_total": self.kv.prefix.num_evicted if self.kv.prefix else 0,
            **{f"kv_handoffs_{k}_total": v for k, v in self.handoff_counts.items()},
        }

    def check_integrity(self) -> None:
        """KV bookkeeping: every block free or held exactly by the requests listing it."""
        self.kv.check_integrity()
        for rid in self.kv.holders():
            if rid not in self._requests:
                raise AssertionError(f"blocks held by unknown request {rid}")
