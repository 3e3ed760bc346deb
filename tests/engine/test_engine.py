"""Engine scenarios on a tiny random Llama: greedy parity with HF, chunking, preemption,
stops, sampling, aborts. The block-pool integrity check runs after every scenario."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from prelude import LLM, SamplingParams
from prelude.engine.client import InvalidRequestError
from prelude.engine.engine import LLMEngine

from tests.engine.tiny import hf_tiny_llama, tiny_engine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    return hf_tiny_llama()


@pytest.fixture
def make_engine(hf_model) -> Iterator:  # noqa: ANN001
    made: list[LLMEngine] = []

    def factory(**kw) -> LLMEngine:  # noqa: ANN003
        engine = tiny_engine(hf_model, **kw)
        made.append(engine)
        return engine

    yield factory
    for engine in made:  # after every scenario: nothing leaked, bookkeeping consistent
        engine.check_integrity()
        assert not engine.has_unfinished()
        assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 9, 30, 1, 12)]


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(),  # everything fits
        dict(max_num_batched_tokens=8),  # long prompts chunked, chunks mixed with decodes
        dict(num_blocks=14, max_num_batched_tokens=16),  # KV pressure: preemption by recompute
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_greedy_matches_hf_generate(hf_model, make_engine, engine_kw) -> None:  # noqa: ANN001
    engine = make_engine(**engine_kw)
    llm = LLM(engine=engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = llm.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results):
        assert result.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
        assert result.outputs[0].finish_reason == "length"


def test_preemption_happens_and_recovers(hf_model, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(num_blocks=10, max_num_batched_tokens=16, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(PROMPTS[:4])]
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        engine.check_integrity()
    assert sum(r.num_preemptions for r in reqs) > 0
    for r, p in zip(reqs, PROMPTS[:4]):
        assert outs[r.request_id] == hf_greedy(hf_model, p, 10)


def test_stop_strings_are_not_leaked(make_engine) -> None:  # noqa: ANN001
    llm = LLM(engine=make_engine())
    free = llm.generate([[65, 66, 67]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) >= 6
    stop = text[3:5]
    cut = llm.generate([[65, 66, 67]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,)))
    out = cut[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        [[65, 66, 67]],
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_eos_and_ignore_eos(make_engine) -> None:  # noqa: ANN001
    engine = make_engine()
    llm = LLM(engine=engine)
    base = llm.generate([[70, 71]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_tok = base.token_ids[2]
    out = llm.generate([[70, 71]], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop_tok,)))[0].outputs[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # Make <eos> the greedy choice through the engine's eos set: it ends generation
    # unless ignore_eos.
    engine.eos_token_ids = frozenset({base.token_ids[0]})
    stopped = llm.generate([[70, 71]], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert stopped.token_ids == base.token_ids[:1] and stopped.finish_reason == "stop"
    ignored = llm.generate([[70, 71]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == base.token_ids


def test_seeded_sampling_is_reproducible_and_n_differs(make_engine) -> None:  # noqa: ANN001
    llm = LLM(engine=make_engine())
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, ignore_eos=True, seed=123, n=3)
    a = llm.generate([[80, 81, 82]], params)[0].outputs
    b = llm.generate([[80, 81, 82]], params)[0].outputs
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1


def test_sampling_filters_restrict_support(make_engine) -> None:  # noqa: ANN001
    llm = LLM(engine=make_engine())
    greedy = llm.generate([[90, 91]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=6, ignore_eos=True, seed=1),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=6, ignore_eos=True, seed=2),
        SamplingParams(temperature=1.5, min_p=1.0, max_tokens=6, ignore_eos=True, seed=3),
    ):
        out = llm.generate([[90, 91]], params)[0].outputs[0]
        assert out.token_ids == greedy.token_ids


def test_penalties_change_greedy_choice(make_engine) -> None:  # noqa: ANN001
    llm = LLM(engine=make_engine())
    plain = llm.generate([[100, 101]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(set(plain.token_ids)) < len(plain.token_ids)  # a random tiny model repeats itself
    pen = llm.generate(
        [[100, 101]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    )[0].outputs[0]
    rep = llm.generate([[100, 101]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=5.0))[0].outputs[0]
    assert len(set(pen.token_ids)) > len(set(plain.token_ids))
    assert len(set(rep.token_ids)) > len(set(plain.token_ids))


def test_logprobs_match_hf_log_softmax(hf_model, make_engine) -> None:  # noqa: ANN001
    llm = LLM(engine=make_engine())
    prompt = [40, 41, 42, 43]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3))[0].outputs[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), -1)
    assert out.logprobs is not None and len(out.logprobs) == 4
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the top token


def test_max_tokens_zero_and_context_limits(make_engine) -> None:  # noqa: ANN001
    engine = make_engine(max_model_len=40)
    llm = LLM(engine=engine)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=0))[0].outputs[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    with pytest.raises(InvalidRequestError):
        engine.add_request("long", list(range(40)), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError):
        engine.add_request("over", list(range(30)), SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequestError):
        engine.add_request("oov", [1, 999], SamplingParams(max_tokens=1))
    # max_tokens=None fills the context exactly.
    full = llm.generate([list(range(30))], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0))[0].outputs[0]
    assert len(full.token_ids) == 10 and full.finish_reason == "length"


def test_a_request_that_needs_the_whole_pool_runs(hf_model, make_engine) -> None:  # noqa: ANN001
    """Admission keeps a watermark free for running decodes; with none running it kept a
    pool of one or two blocks from ever admitting a request that fits it (a hang)."""
    for blocks in (1, 2):
        engine = make_engine(num_blocks=blocks, block_size=4, max_model_len=4 * blocks)
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        prompts = {"whole": PROMPTS[3][: 4 * blocks - 2], "short": PROMPTS[3][:1]}
        outs: dict[str, list[int]] = {name: [] for name in prompts}
        for name, prompt in prompts.items():
            engine.add_request(name, prompt, params)
        for _ in range(50):  # steps enough many times over; a request never admitted fails, not hangs
            if not engine.has_unfinished():
                break
            for o in engine.step():
                outs[o.request_id].extend(o.new_token_ids)
        assert outs == {name: hf_greedy(hf_model, p, 2) for name, p in prompts.items()}


def test_seeds_past_2_63_sample_by_their_64_bits(make_engine) -> None:  # noqa: ANN001
    """The sampler holds seeds as int64: 2**63 and up overflowed there and failed the step
    (every request in it). A seed is its 64 bits: 2**64 - 1 samples as -1 does."""
    engine = make_engine()
    llm = LLM(engine=engine)

    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=seed)
        return llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids

    assert sample(2**64 - 1) == sample(-1) and sample(2**63) == sample(-(2**63))
    assert len(sample(2**63 + 5)) == 6
    two = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=4, seed=2**64 - 1, n=2))[0].outputs
    assert len(two) == 2  # choice 1 takes seed + 1, wrapped to 0


def test_sampling_params_refuse_what_the_sampler_cannot_take() -> None:
    from prelude.params import SamplingParamsError

    for bad in (dict(seed=2**64), dict(seed=-(2**63) - 1), dict(repetition_penalty=float("nan")),
                dict(repetition_penalty=float("inf")), dict(repetition_penalty=0.0)):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)


def test_abort_frees_blocks(make_engine) -> None:  # noqa: ANN001
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_blocks < engine.kv.pool.num_blocks
    for i in range(len(PROMPTS)):
        assert engine.abort(str(i))
    assert not engine.abort("0")
    engine.check_integrity()


def test_multibyte_streaming_text(make_engine) -> None:  # noqa: ANN001
    """Byte tokens split UTF-8 characters: streamed increments never hold half a character."""
    from prelude.engine.output_processor import new_stream, process_token

    engine = make_engine()
    req = engine.prepare("mb", [65], SamplingParams(max_tokens=20))
    stream = new_stream(engine.tokenizer, req)
    text = "héllo €𝄞 ok"
    pieces = []
    for b in text.encode():
        pieces.append(process_token(req, stream, b, None, 1000).text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_finished_records_add_nothing_for_the_garbage_collector_to_walk() -> None:
    """The engine keeps its last 10,000 records for /v1/request_metrics: as objects the
    collector tracks, every full collection (GIL held) would walk them all. After a
    collection only the deque holding them is tracked, and they read back whole."""
    import gc

    engine = tiny_engine(hf_tiny_llama())
    for i in range(20):
        engine.add_request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.step()
    gc.collect()
    records = engine._finished
    assert len(records) == 20 and not any(gc.is_tracked(r) for r in records)
    metrics = engine.finished_metrics
    assert [m.request_id for m in metrics] == [f"r{i}" for i in range(20)]
    assert all(m.output_tokens == 2 and m.prompt_tokens == 3 and m.ttft_s is not None for m in metrics)


def test_requests_running_counts_every_request_being_computed_oneshot_rows_included(make_engine) -> None:  # noqa: ANN001
    """vLLM's num_requests_running: an admitted Paged request and a OneShot row in the same
    (fused) step both count while the step computes; a finished request no longer does."""
    engine = make_engine()
    engine.add_request("paged", list(range(5, 12)), SamplingParams(max_tokens=3, temperature=0.0))
    engine.add_request("oneshot", list(range(5, 15)), SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.metrics()["requests_running"] == 0 and engine.metrics()["requests_waiting"] == 2
    during: list[dict[str, float]] = []
    engine.step(on_heads=lambda: during.append(engine.metrics()))
    assert [(m["requests_running"], m["requests_running_paged"], m["requests_running_oneshot"]) for m in during] \
        == [(2, 1, 1)]
    after = engine.metrics()  # the OneShot request ended with its step; the Paged one decodes on
    assert (after["requests_running"], after["requests_running_paged"], after["requests_running_oneshot"]) == (1, 1, 0)
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics()["requests_running"] == 0


def test_a_oneshot_step_in_flight_counts_as_running(hf_model) -> None:  # noqa: ANN001
    """With overlap a OneShot step stays in flight after `step` returns: its request runs."""
    engine = tiny_engine(hf_model, overlap=True)
    engine.add_request("oneshot", list(range(5, 15)), SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.step() == [] and engine.metrics()["requests_running"] == 1
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["oneshot"] and engine.metrics()["requests_running"] == 0
    engine.check_integrity()


def test_the_scheduler_ends_every_request_it_is_told_to(make_engine) -> None:  # noqa: ANN001
    """Request.status has one writer (the scheduler): a request that needs no forward, an
    aborted one and one that ran to its end all end FINISHED, out of every queue."""
    from prelude.engine.request import RequestStatus

    engine = make_engine()
    none = engine.add_request("none", [5, 6], SamplingParams(max_tokens=0))
    gone = engine.add_request("gone", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    done = engine.add_request("done", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    assert none.status is RequestStatus.FINISHED and gone.status is done.status is RequestStatus.WAITING
    engine.step()
    assert gone.status is done.status is RequestStatus.RUNNING
    assert engine.abort("gone") and gone.status is RequestStatus.FINISHED
    while engine.has_unfinished():
        engine.step()
    assert done.status is RequestStatus.FINISHED and not engine.scheduler.has_work()
