"""Prefill/decode disaggregation on a hybrid model (random Qwen3.5): the hand-off carries
the request's recurrent state (each linear layer's conv and delta-rule state) with its
KV blocks, so a request prefilled on one engine and decoded on another gives the tokens
of one engine; slots and blocks come back on both sides."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from prelude.engine.engine import LLMEngine
from prelude.engine.request import RequestOutput, SamplingParams
from tests.engine.tiny import hf_tiny_hybrid, hf_tiny_llama, tiny_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_tiny_hybrid()


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return outs


def _idle(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert not engine.kv.holders()
    assert (engine.kv.num_free_slots or 0) == engine.num_state_slots


PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("prefill_kw", [dict(), dict(max_num_batched_tokens=8)], ids=["whole", "chunked"])
def test_disaggregated_greedy_tokens_equal_a_local_run(hf: Any, prefill_kw: dict[str, Any]) -> None:
    local = tiny_engine(hf)
    for i, p in enumerate(PROMPTS):
        local.add_request(str(i), p, PARAMS)
    want = _run(local)
    prefill, decode = tiny_engine(hf, **prefill_kw), tiny_engine(hf)
    decode.add_request("other", list(range(70, 80)), PARAMS)  # holds the decode side's first slot
    decode.step()
    for i, p in enumerate(PROMPTS):
        prefill.enqueue(replace(prefill.prepare(str(i), p, PARAMS), hand_off=True))
    got = _run(prefill)
    handoffs = prefill.take_handoffs()
    assert len(handoffs) == len(PROMPTS)
    linear = len(hf.config.layer_types) - hf.config.layer_types.count("full_attention")
    for h in handoffs:  # KV of the attention layers only, the state of the linear ones
        assert len(h.kv) == hf.config.layer_types.count("full_attention") and len(h.state) == linear
        assert h.state[0][1].dtype == torch.float32 and h.state[0][1].abs().sum() > 0
    _idle(prefill)
    for h in handoffs:
        decode.import_kv(h)
    for rid, toks in _run(decode).items():
        got.setdefault(rid, []).extend(toks)
    got.pop("other")
    assert got == want
    _idle(decode)
    assert decode.metrics()["kv_handoffs_imported_total"] == len(PROMPTS)


def test_no_free_slot_on_the_decode_side_recomputes(hf: Any) -> None:
    local, prefill = tiny_engine(hf), tiny_engine(hf)
    decode = tiny_engine(hf, max_recurrent_slots=1)
    prompt = PROMPTS[2]
    local.add_request("x", prompt, PARAMS)
    want = _run(local)["x"]
    decode.add_request("hog", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    decode.step()  # "hog" holds the only slot
    prefill.enqueue(replace(prefill.prepare("x", prompt, PARAMS), hand_off=True))
    got = _run(prefill)["x"]
    decode.import_kv(prefill.take_handoffs()[0])
    assert decode.metrics()["kv_handoffs_imported_recomputed_total"] == 1
    assert got + _run(decode)["x"] == want
    _idle(decode)


def test_a_handoff_between_a_dense_and_a_hybrid_model_is_refused(hf: Any) -> None:
    dense, hybrid = tiny_engine(hf_tiny_llama()), tiny_engine(hf)
    for source, target in ((dense, hybrid), (hybrid, dense)):
        source.enqueue(replace(source.prepare("y", [4, 5, 6, 7], PARAMS), hand_off=True))
        _run(source)
        with pytest.raises(ValueError, match="does not fit this engine"):
            target.import_kv(source.take_handoffs()[0])
        _idle(target)
        assert not target.has_unfinished()
