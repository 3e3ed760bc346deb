"""Per-request latency records: TTFT, TPOT, JCT, normalized TTFT, SLO met."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from prelude.forward_batch import DecodeBatch, MixedBatch, OneShotBatch
from prelude.engine.request import Request


class RequestMetrics(NamedTuple):
    """One finished request's record (the engine keeps the last 10,000 as plain tuples)."""

    request_id: str
    exec_class: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first
    jct_s: float | None  # arrival to finish
    normalized_ttft_s: float | None  # TTFT / prompt tokens
    ttft_slo_ms: float | None
    slo_met: bool | None  # None when the request had no TTFT target
    preemptions: int
    queue_s: float | None = None  # arrival to first scheduled
    finish_reason: str | None = None


class EngineObserver(Protocol):
    """Told of every finished request and every step (on the engine thread): the server's
    Prometheus metrics subscribe here. Implementations must be cheap and must not raise."""

    def request_finished(self, metrics: RequestMetrics) -> None: ...

    def step_finished(self, kind: str, seconds: float, num_tokens: int) -> None: ...


def batch_kind(batch: object) -> tuple[str, int]:
    """(oneshot | decode | prefill | mixed, tokens computed) of one step's batch."""
    if isinstance(batch, OneShotBatch):
        return "oneshot", sum(len(r.token_ids) - r.num_cached for r in batch.rows)
    if isinstance(batch, DecodeBatch):
        return "decode", len(batch.rows)
    if isinstance(batch, MixedBatch):
        tokens = sum(len(r.token_ids) for r in batch.prefill_rows) + len(batch.decode_rows)
        tokens += sum(len(r.token_ids) - r.num_cached for r in batch.oneshot_rows)
        return ("mixed" if batch.decode_rows or batch.oneshot_rows else "prefill"), tokens
    return "other", 0


def request_metrics(req: Request) -> RequestMetrics:
    ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
    jct = None if req.finish_time is None else req.finish_time - req.arrival_time
    n_out = len(req.output_token_ids)
    tpot = None
    if req.finish_time is not None and req.first_token_time is not None and n_out > 1:
        tpot = (req.finish_time - req.first_token_time) / (n_out - 1)
    slo = req.params.ttft_slo_ms
    return RequestMetrics(
        request_id=req.request_id,
        exec_class=req.exec_class.value,
        prompt_tokens=req.num_prompt_tokens,
        output_tokens=n_out,
        ttft_s=ttft,
        tpot_s=tpot,
        jct_s=jct,
        normalized_ttft_s=None if ttft is None else ttft / max(1, req.num_prompt_tokens),
        ttft_slo_ms=slo,
        slo_met=None if slo is None or ttft is None else ttft * 1000 <= slo,
        preemptions=req.num_preemptions,
        queue_s=None if req.scheduled_time is None else req.scheduled_time - req.arrival_time,
        finish_reason=None if req.finish_reason is None else req.finish_reason.value,
    )
