"""KV export/import between two LLMEngine instances (no Ray): a request prefilled on one
engine and decoded on another continues exactly as it would have on one engine (greedy
and seeded sampling, stop strings held back across the hand-off, logprobs), both block
pools stay consistent, an abort on the decode side frees its blocks, and a decode engine
with no room recomputes instead of failing."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("transformers")

from prelude.engine.engine import LLMEngine  # noqa: E402
from prelude.engine.handoff import KVHandoff  # noqa: E402
from prelude.engine.request import RequestOutput, SamplingParams  # noqa: E402

from tests.engine.tiny import hf_tiny_llama, tiny_engine  # noqa: E402


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_tiny_llama()


def _run(engine: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def _joined(outs: list[RequestOutput]) -> dict[str, tuple[list[int], str, str | None, list[float]]]:
    """Per request: tokens, text, finish reason, logprobs, accumulated over increments."""
    acc: dict[str, tuple[list[int], str, str | None, list[float]]] = {}
    for o in outs:
        toks, text, _, lps = acc.get(o.request_id, ([], "", None, []))
        acc[o.request_id] = (toks + list(o.new_token_ids), text + o.text,
                             o.finish_reason.value if o.finish_reason else None,
                             lps + [lp.logprob for lp in o.logprobs])
    return acc


PROMPTS = ["hello world, this is a prompt", "abc", "the quick brown fox jumps over the lazy dog " * 3]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=17, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=("zz", "q")),
]


def _disaggregated(prefill: LLMEngine, decode: LLMEngine, cases: list[tuple[str, str, SamplingParams]]
                   ) -> tuple[list[RequestOutput], list[KVHandoff]]:
    for rid, prompt, params in cases:
        req = prefill.prepare(rid, list(prompt.encode()), params)
        prefill.enqueue(replace(req, hand_off=True))
    outs = _run(prefill)
    handoffs = prefill.take_handoffs()
    for h in handoffs:
        decode.import_kv(h)
    return outs + _run(decode), handoffs


def test_prefill_on_one_engine_decode_on_another_equals_one_engine(hf: Any) -> None:
    colocated, prefill, decode = (tiny_engine(hf) for _ in range(3))
    cases = [(f"r{i}-{j}", p, params) for i, p in enumerate(PROMPTS) for j, params in enumerate(PARAMS)]
    for rid, prompt, params in cases:
        colocated.add_request(rid, list(prompt.encode()), params)
    want = _joined(_run(colocated))
    outs, handoffs = _disaggregated(prefill, decode, cases)
    got = _joined(outs)
    assert got.keys() == want.keys()
    for rid in want:
        (gt, gx, gf, gl), (wt, wx, wf, wl) = got[rid], want[rid]
        assert (gt, gx, gf) == (wt, wx, wf), rid
        assert gl == pytest.approx(wl, abs=1e-4)
    # Every request that did not finish on its first token was handed off, once.
    assert {h.request_id for h in handoffs} == set(want)
    assert all(h.num_blocks == -(-h.num_computed_tokens // 4) for h in handoffs)
    # The prefill engine holds nothing; its published prompt blocks stay in its cache.
    for e in (prefill, decode):
        e.check_integrity()
        assert not e.kv.holders()
    assert prefill.metrics()["kv_handoffs_exported_total"] == len(handoffs)
    assert decode.metrics()["kv_handoffs_imported_total"] == len(handoffs)
    assert prefill.kv.pool.num_evictable_blocks > 0
    # One latency record per request, on the decode side, with the prefill side's TTFT.
    assert not prefill.finished_metrics
    records = {m.request_id: m for m in decode.finished_metrics}
    assert records.keys() == want.keys()
    assert all(m.ttft_s is not None and m.ttft_s > 0 and m.tpot_s is not None for m in records.values())
    # The first token came from the prefill engine, the rest from the decode engine.
    first = {o.request_id: o for o in outs[: len(cases)]}
    assert all(len(o.new_token_ids) == 1 and not o.finished for o in first.values())


def test_finished_on_first_token_is_not_handed_off(hf: Any) -> None:
    prefill = tiny_engine(hf)
    req = prefill.prepare("one", list(b"short"), SamplingParams(max_tokens=1, temperature=0))
    prefill.enqueue(replace(req, hand_off=True))
    outs = _run(prefill)
    assert len(outs) == 1 and outs[0].finished and prefill.take_handoffs() == []
    prefill.check_integrity()


def test_abort_on_the_decode_side_frees_its_blocks(hf: Any) -> None:
    prefill, decode = tiny_engine(hf), tiny_engine(hf)
    free = decode.kv.pool.num_free_blocks
    _, handoffs = _disaggregated(prefill, decode, [])
    req = prefill.prepare("long", list(b"a prompt of some length"), SamplingParams(max_tokens=100, ignore_eos=True))
    prefill.enqueue(replace(req, hand_off=True))
    _run(prefill)
    (h,) = prefill.take_handoffs()
    decode.import_kv(h)
    decode.step()
    assert decode.kv.pool.num_free_blocks < free
    assert decode.abort("long")
    decode.check_integrity()
    assert not decode.kv.holders()
    assert decode.kv.pool.num_free_blocks + decode.kv.pool.num_evictable_blocks == free


def test_no_room_on_the_decode_side_recomputes(hf: Any) -> None:
    colocated, prefill = tiny_engine(hf), tiny_engine(hf)
    # The prompt's 8 blocks fit only once "hog" has finished.
    decode = tiny_engine(hf, num_blocks=10, max_model_len=40)
    prompt, params = list(b"0123456789abcdefghijklmnopqrstu"), SamplingParams(max_tokens=6, temperature=0,
                                                                              ignore_eos=True)
    colocated.add_request("x", prompt, params)
    want = _joined(_run(colocated))["x"]
    decode.add_request("hog", list(b"hog hog"), SamplingParams(max_tokens=4, ignore_eos=True))
    decode.step()  # "hog" holds blocks now
    prefill.enqueue(replace(prefill.prepare("x", prompt, params), hand_off=True))
    first = _run(prefill)
    decode.import_kv(prefill.take_handoffs()[0])
    assert decode.metrics()["kv_handoffs_imported_recomputed_total"] == 1
    got = _joined(first + [o for o in _run(decode) if o.request_id == "x"])["x"]
    assert got[:3] == want[:3]
    decode.check_integrity()


def test_a_handoff_that_does_not_fit_is_refused(hf: Any) -> None:
    prefill, decode = tiny_engine(hf), tiny_engine(hf, block_size=8)
    prefill.enqueue(replace(prefill.prepare("y", list(b"some prompt"), SamplingParams(max_tokens=5)), hand_off=True))
    _run(prefill)
    with pytest.raises(ValueError, match="does not fit"):
        decode.import_kv(prefill.take_handoffs()[0])
    decode.check_integrity()
    assert not decode.has_unfinished()


def test_a_failed_copy_in_frees_what_the_import_took(hf: Any) -> None:
    """The scheduler allocates the blocks and the runner fills them: when the fill raises,
    the blocks go back and the request is not left half-imported."""
    prefill, decode = tiny_engine(hf), tiny_engine(hf)
    free = decode.kv.pool.num_free_blocks
    prefill.enqueue(replace(prefill.prepare("z", list(b"a prompt to copy"), SamplingParams(max_tokens=8)), hand_off=True))
    _run(prefill)

    def broken_copy(table: list[int], kv: Any) -> None:
        raise RuntimeError("device copy failed")

    decode.runner.write_kv_blocks = broken_copy  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device copy failed"):
        decode.import_kv(prefill.take_handoffs()[0])
    decode.check_integrity()
    assert not decode.has_unfinished() and not decode.kv.holders()
    assert decode.kv.pool.num_free_blocks == free
