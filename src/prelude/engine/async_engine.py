"""The async front: one engine loop thread, many concurrent callers with their own streams.

Callers (HTTP handlers) prepare requests on their own thread, then hand them to the
engine thread through an inbox; the engine thread runs the step loop and pushes each
request's increments to that request's asyncio queue. Closing a stream early aborts
its request, which frees its KV blocks at the start of the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, TypeVar

from prelude.engine import stage_trace
from prelude.engine.engine import LLMEngine
from prelude.engine.errors import EngineDeadError, StepFailed
from prelude.engine.handoff import KVHandoff
from prelude.engine.metrics import EngineObserver, RequestMetrics
from prelude.engine.request import LoraRequest, PoolingParams, Request, RequestOutput, SamplingParams
from prelude.params import EmbedSetup
from prelude.tokenizer.base import Tokenizer

logger = logging.getLogger("prelude.async_engine")
T = TypeVar("T")


class EngineStepError(RuntimeError):
    """The model step failed; the requests in that step are failed with this error."""


# Loop iterations in a row that may fail before the engine thread gives up: one failure
# is survived (the requests concerned are failed), a loop that keeps failing is dead.
_MAX_CONSECUTIVE_LOOP_FAILURES = 3
NAP_S = 0.002  # the loop's nap while the engine holds work back on purpose (until news)


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[RequestOutput | KVHandoff | BaseException]"


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 while_building: Callable[[], object] | None = None) -> None:
        """Takes an engine, or a factory that builds it on the engine thread.

        Prefer the factory: torch's OpenMP thread team belongs to the thread that first
        runs parallel work, and a forward issued from another thread than the one that
        loaded the weights runs slower.
        `while_building` runs on the calling thread while the factory builds (the server's
        own imports: much of a build is torch work that leaves the GIL free).
        """
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: deque[tuple[str, object]] = deque()
        self._sinks: dict[str, _Sink] = {}
        self._held: list[RequestOutput] = []  # streaming increments handed over in the next step's heads
        self._stopping = False
        self._dead: str | None = None  # why the engine loop stopped for good
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.engine: LLMEngine = engine if isinstance(engine, LLMEngine) else None  # type: ignore[assignment]
        factory = None if isinstance(engine, LLMEngine) else engine
        self._thread = threading.Thread(target=self._run, args=(factory,), name="prelude-engine", daemon=True)
        self._thread.start()
        if while_building is not None:
            while_building()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    # --- EngineClient ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def metrics(self) -> dict[str, float]:
        # Plain counter reads: a slightly stale snapshot is fine for monitoring.
        return self.engine.metrics()

    def request_metrics(self) -> list[RequestMetrics]:
        return self.engine.finished_metrics

    def set_observer(self, observer: EngineObserver) -> None:
        """Subscribe to finished requests and steps (called on the engine thread)."""
        self.engine.observer = observer

    async def call_on_engine_thread(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` between two steps, where engine state is consistent."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
            self._inbox.append(("call", (fn, future)))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def integrity(self) -> dict[str, object]:
        """The block pool's integrity check and where every block is (debug route, soak)."""

        def check(engine: LLMEngine) -> dict[str, object]:
            error = None
            try:
                engine.check_integrity()
            except AssertionError as exc:
                error = str(exc)
            pool = engine.kv.pool
            free, cached = pool.num_free_blocks, pool.num_evictable_blocks
            out: dict[str, object] = {
                "ok": error is None, "error": error, "blocks_total": pool.num_blocks, "blocks_free": free,
                "blocks_cached_unreferenced": cached, "blocks_held": pool.num_blocks - free - cached,
                "requests_in_engine": engine.num_unfinished}
            windows = engine.kv.windows
            if windows is not None:  # the sliding layers' pool (kv/window_tables.py)
                wfree, wcached = windows.pool.num_free_blocks, windows.pool.num_evictable_blocks
                out |= {"window_blocks_total": windows.pool.num_blocks, "window_blocks_free": wfree,
                        "window_blocks_cached_unreferenced": wcached,
                        "window_blocks_held": windows.pool.num_blocks - wfree - wcached}
            return out

        return await self.call_on_engine_thread(check)

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def labels(self) -> tuple[str, ...]:
        return self.engine.labels

    @property
    def can_generate(self) -> bool:
        return self.engine.can_generate

    @property
    def is_encoder(self) -> bool:
        return self.engine.is_encoder

    @property
    def embed_setup(self) -> EmbedSetup:
        return self.engine.embed_setup

    @property
    def score_template(self) -> str | None:
        return self.engine.score_template

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora: LoraRequest | None = None
    ) -> AsyncIterator[RequestOutput]:
        return self._stream(request_id, prompt_token_ids, params, None, lora)

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams,
                     lora: LoraRequest | None = None) -> RequestOutput:
        """One fixed-size result (embedding, head scores, label logprobs)."""
        async for out in self._stream(request_id, prompt_token_ids, SamplingParams(max_tokens=0), pooling, lora):
            if out.finished:
                return out
        raise RuntimeError(f"request {request_id} ended without a result")

    async def check_adapter(self, lora: LoraRequest) -> tuple[str, ...]:
        """Read and check a LoRA adapter off the event loop (raises ValueError saying why);
        the labels of its own classification head, or ()."""
        return await asyncio.to_thread(self.engine.check_adapter, lora)

    async def _stream(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams | None,
        lora: LoraRequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        req = self.engine.prepare(request_id, prompt_token_ids, params, pooling, lora)  # InvalidRequestError -> caller
        async for out in self.submit(req):
            yield out

    def submit(self, req: Request) -> AsyncIterator[RequestOutput | KVHandoff]:
        """Stream a request validated elsewhere (a scale-out front validates once, a replica
        runs it); closing the stream early aborts it, as with generate(). A request with
        `hand_off` set ends, unless its first token finished it, with its KVHandoff.
        Returns `_submit`'s stream itself: a generator layer around it cost every token
        of every stream a resumption more."""
        trace = stage_trace.current.get()
        if trace is not None:
            req.trace = trace
            trace.mark("validate")
        return self._submit(req.request_id, ("add", req))

    async def resume(self, handoff: KVHandoff) -> AsyncIterator[RequestOutput]:
        """Continue a request another engine prefilled (its KV imported here): the
        increments after its first token. Closing the stream early aborts it."""
        async for item in self._submit(handoff.request_id, ("import", handoff)):
            assert isinstance(item, RequestOutput)
            yield item

    async def _submit(self, request_id: str, inbox_item: tuple[str, object]) -> AsyncIterator[RequestOutput | KVHandoff]:
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = sink
            self._inbox.append(inbox_item)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                stage_trace.mark("hop_back")
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, KVHandoff) or item.finished:  # a hand-off ends this engine's part
                    finished = True
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._sinks.pop(request_id, None)
                if not finished:
                    self._inbox.append(("abort", request_id))
            if not finished:  # a finished request leaves the engine nothing to do: no wake-up
                self._wake.set()

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams | None = None,
        lora: LoraRequest | None = None,
    ) -> None:
        self.engine.prepare("validate", prompt_token_ids, params, pooling, lora)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def fail_all(self, error: BaseException) -> int:
        """End every request in flight with `error` (e.g. a drain past its timeout) and
        abort it in the engine; returns how many there were."""
        with self._lock:
            ids = list(self._sinks)
            for rid in ids:
                self._inbox.append(("abort", rid))
        for rid in ids:
            self._deliver(rid, error)
        self._wake.set()
        return len(ids)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    # --- the engine thread ----------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | KVHandoff | BaseException) -> None:
        with self._lock:
            sink = self._sinks.get(request_id)
        if sink is None:
            return  # the caller is gone; its abort is already in the inbox
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed
            pass

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one wake-up per event loop: call_soon_threadsafe writes to the
        loop's self-pipe, and one write per output was a syscall and a loop wake-up each
        (64 per step at c=64 decode)."""
        if len(outputs) == 1:
            self._deliver(outputs[0].request_id, outputs[0])
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:  # else the caller is gone; its abort is already in the inbox
                    by_loop.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed
                pass

    def _release_held(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self._deliver_step(held)

    def _drain_inbox(self) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, payload in items:
            if kind == "call":
                fn, future = payload  # type: ignore[misc]
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - the caller's
                    future.set_exception(exc)
                continue
            if kind == "abort":
                self.engine.abort(payload)  # type: ignore[arg-type]
                continue
            if kind == "import":
                assert isinstance(payload, KVHandoff)
                try:
                    self.engine.import_kv(payload)
                except Exception as exc:  # noqa: BLE001 - reported to that caller only
                    self._deliver(payload.request_id, exc)
                continue
            req = payload
            assert isinstance(req, Request)
            if req.trace is not None:
                req.trace.mark("hop_to_engine")
            try:
                self.engine.enqueue(req)
            except Exception as exc:  # noqa: BLE001 - reported to that caller only
                self._deliver(req.request_id, exc)

    def _log_activity(self) -> None:
        m = self.engine.metrics()
        logger.info(
            "running %d, waiting %d, KV free %d/%d, prefix hit rate %.1f%% (%d reused / %d computed tokens)",
            m["requests_running"], m["requests_waiting"], m["kv_blocks_free"], m["kv_blocks_total"],
            100 * m["prefix_cache_hit_rate"], m["prefix_reused_tokens_total"], m["prefix_computed_tokens_total"],
        )

    def _iteration(self) -> None:
        """One turn of the loop: apply the inbox, run a step, deliver its outputs.

        Where the step's heads outweigh its trunk on a CPU (a small model with a large
        vocabulary, `LLMEngine.heads_heavy`), its streaming increments (neither a request's
        first output nor its last) are held and handed over when the next step's heads
        start: the engine thread then sits in native kernels outside the GIL, and the HTTP
        thread serializes and sends them alongside. Handed over at the end of the step,
        the HTTP thread's Python took the GIL from the next step's trunk, which releases it
        at every torch op, and the two ran one after the other. A held increment arrives
        one trunk later and so does every later one: the time
        between tokens is what drops; the first token and the last are never held."""
        self._drain_inbox()
        if not self.engine.has_unfinished():
            self._release_held()
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            return
        try:
            outputs = self.engine.step(self._release_held if self._held else None)
        except StepFailed as exc:  # contained by the engine: only that step's requests fail
            self._release_held()
            logger.error("engine step failed; failing its %d requests: %r", len(exc.request_ids), exc.cause,
                         exc_info=exc.cause)
            error = EngineStepError(str(exc))
            for rid in exc.request_ids:
                self._deliver(rid, error)
            return
        self._release_held()  # still held: the step launched nothing, so no heads handed them over
        now = outputs
        if self.engine.heads_heavy:
            self._held = [out for out in outputs if not out.finished and out.num_output_tokens > 1]
            if self._held:
                now = [out for out in outputs if out.finished or out.num_output_tokens <= 1]
        if now:
            self._deliver_step(now)
        for handoff in self.engine.take_handoffs():  # after its first-token output
            self._deliver(handoff.request_id, handoff)
        if self.engine.idle and not outputs:
            # The policy holds work back (a batching window): nap briefly, or until news; a
            # OneShot gather's hold no longer than it lasts (on a GPU a lone long prompt's
            # hold is a fraction of the nap, which would otherwise delay it by a whole nap)
            hold_s = self.engine.hold_s
            self._wake.wait(timeout=min(NAP_S, hold_s) if hold_s > 0 else NAP_S)
            self._wake.clear()

    def _fail_everything(self, exc: BaseException) -> None:
        """After an unexpected loop failure: every waiting handler gets an error, and the
        engine forgets every request (its blocks freed), so nothing waits forever."""
        error = EngineStepError(f"engine loop failed: {type(exc).__name__}: {exc}")
        with self._lock:
            ids = list(self._sinks)
        for rid in ids:
            self._deliver(rid, error)
        try:
            self.engine.abort_all()
        except Exception:  # noqa: BLE001 - the next iteration's failure count decides
            logger.exception("abort_all failed after a loop failure")

    def _die(self, reason: str) -> None:
        """The loop stops for good: refuse new requests, fail every waiting one."""
        with self._lock:
            self._dead = reason
            ids = list(self._sinks)
            calls = [payload for kind, payload in self._inbox if kind == "call"]
            self._inbox.clear()
        error = EngineDeadError(f"the engine loop has stopped: {reason}")
        for _, future in calls:  # type: ignore[misc]
            future.set_exception(error)
        for rid in ids:
            self._deliver(rid, error)

    def _run(self, factory: Callable[[], LLMEngine] | None) -> None:
        try:
            if factory is not None:
                self.engine = factory()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the constructor
            self._build_error = exc
            return
        finally:
            self._built.set()
        last_log, logged, failures = time.monotonic(), None, 0
        try:
            while not self._stopping:
                try:
                    if time.monotonic() - last_log > 30:  # a short activity line, when it changed
                        last_log = time.monotonic()
                        m = self.engine.metrics()
                        snapshot = (m["prefix_cache_queries_total"], m["kv_blocks_free"])
                        if snapshot != logged:
                            logged = snapshot
                            self._log_activity()
                    self._iteration()
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - the thread must never die silently
                    self._release_held()  # produced before the failure: they go first
                    failures += 1
                    logger.exception("engine loop iteration failed (%d in a row)", failures)
                    self._fail_everything(exc)
                    if failures >= _MAX_CONSECUTIVE_LOOP_FAILURES:
                        self._die(f"{failures} loop failures in a row, the last: {type(exc).__name__}: {exc}")
                        return
        except BaseException as exc:  # noqa: BLE001 - e.g. SystemExit raised inside a step
            self._die(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._release_held()
            if self._dead is None:
                self._die("the engine was shut down" if self._stopping else "the engine thread exited")
