"""Per-request latency records: TTFT, TPOT, JCT, normalized TTFT, SLO met."""

from __future__ import annotations

from dataclasses import dataclass

from prelude.engine.request import Request


@dataclass(frozen=True)
class RequestMetrics:
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
    )
