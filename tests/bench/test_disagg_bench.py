"""`prelude bench cluster --preset mixed` measures what it says, against a fake client whose
token times are known: TTFT, TPOT, the first-to-second token gap, throughput."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest

from prelude.bench.disagg_bench import mixed_trace, replay, summarize
from prelude.engine.request import FinishReason, RequestOutput, SamplingParams


class _Fake:
    """First token after 0.05 s, then one every 0.01 s, except a 0.04 s gap before the second."""

    async def generate(self, rid: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        n = params.max_tokens or 0
        for i in range(n):
            await asyncio.sleep(0.05 if i == 0 else 0.04 if i == 1 else 0.01)
            yield RequestOutput(rid, (7,), "x", (), i == n - 1, FinishReason.LENGTH if i == n - 1 else None,
                                len(prompt), i + 1)


def test_trace_mix_and_measurements() -> None:
    jobs = mixed_trace(40, 50.0, 0, (4, 8), 64, 0.25, short_out=6, long_out=2)
    longs = [j for j in jobs if j.long]
    assert 0 < len(longs) < 40 and all(len(j.prompt) == 64 and j.max_tokens == 2 for j in longs)
    assert all(4 <= len(j.prompt) <= 8 and j.max_tokens == 6 for j in jobs if not j.long)
    done, span = asyncio.run(replay(_Fake(), jobs))
    short = [d for d in done if not d.job.long]
    # Lower bounds only: a sleep never ends early, but how late it ends is the machine's load.
    # Taken between the wrong stamps (one output's own, or a later token's), each would fall short.
    eps = 1e-3
    assert all(d.ttft >= 0.05 - eps for d in done)
    assert all(d.second_gap >= 0.04 - eps for d in done)
    assert all(d.tpot >= (0.04 + 4 * 0.01) / 5 - eps for d in short)
    s = summarize(done, span)
    assert s["throughput_tok_s"] == pytest.approx(sum(j.max_tokens for j in jobs) / span)
    assert s["tpot_p99_s"] >= s["tpot_p50_s"] > 0
