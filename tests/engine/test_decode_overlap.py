"""Decode overlap, device-generic (forced on, on the CPU): step N+1's decode rows are
scheduled and launched before step N is post-processed, their input tokens copied from
step N's sampled ids on the device. Outputs must equal the plain loop's token for token."""

from __future__ import annotations

import torch

from prelude.engine.engine import LLMEngine
from prelude.params import SamplingParams, StructuredOutput
from tests.engine.tiny import ByteTokenizer, hf_tiny_llama, tiny_engine


class _Carried:
    """Records, per launch, the request ids whose input was carried from the step in flight."""

    def __init__(self, engine: LLMEngine) -> None:
        self.launches: list[tuple[str, ...]] = []
        launch = engine.runner.launch

        def recorded(batch, carried=None, on_heads=None):  # noqa: ANN001, ANN202
            self.launches.append(carried.request_ids if carried else ())
            return launch(batch, carried, on_heads)

        engine.runner.launch = recorded  # type: ignore[method-assign]

    @property
    def ids(self) -> set[str]:
        return {rid for launch in self.launches for rid in launch}


def _prompt(i: int) -> list[int]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 250, (5 + 3 * i,), generator=gen).tolist()


def _run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, tuple[list[int], str, str | None, list]]:
    for i, (rid, params) in enumerate(requests.items()):
        engine.add_request(rid, _prompt(i), params)
    got: dict[str, tuple[list[int], str, str | None, list]] = {rid: ([], "", None, []) for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            ids, text, _, lps = got[o.request_id]
            got[o.request_id] = (ids + list(o.new_token_ids), text + o.text,
                                 o.finish_reason.value if o.finish_reason else None, lps + list(o.logprobs))
    engine.check_integrity()
    pool = engine.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks
    return got


def _engines(**kw: object) -> tuple[LLMEngine, LLMEngine]:
    hf = hf_tiny_llama()
    return (tiny_engine(hf, overlap=False, tokenizer=ByteTokenizer(), **kw),  # type: ignore[arg-type]
            tiny_engine(hf, overlap=True, tokenizer=ByteTokenizer(), **kw))  # type: ignore[arg-type]


def test_greedy_seeded_and_logprobs_match_the_plain_loop_and_rows_go_ahead() -> None:
    plain, overlapped = _engines()
    requests = {
        "greedy": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        "seeded2": SamplingParams(max_tokens=15, temperature=1.2, top_k=20, seed=11, ignore_eos=True),
        "logprobs": SamplingParams(max_tokens=7, temperature=0, logprobs=3, ignore_eos=True),
        "one": SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
    }
    want = _run(plain, requests)
    carried = _Carried(overlapped)
    got = _run(overlapped, requests)
    for rid in requests:
        assert got[rid][:3] == want[rid][:3], rid
        assert len(got[rid][0]) == requests[rid].max_tokens  # max_tokens: never one too many
    for a, b in zip(got["logprobs"][3], want["logprobs"][3]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert {"greedy", "seeded", "seeded2", "logprobs"} <= carried.ids


def test_stop_tokens_and_stop_strings_found_one_step_late_end_at_the_same_place() -> None:
    plain, overlapped = _engines()
    free = _run(plain, {"a": SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        "b": SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True)})
    stop_token = free["a"][0][4]  # the 5th token the plain loop produced
    text = free["b"][1]
    stop_text = text[len(text) // 2 : len(text) // 2 + 2]  # two characters out of the middle
    requests = {"a": SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(stop_token,), ignore_eos=True),
                "b": SamplingParams(max_tokens=16, temperature=0.7, seed=3, stop=(stop_text,), ignore_eos=True)}
    plain2, overlapped2 = _engines()
    want = _run(plain2, requests)
    carried = _Carried(overlapped2)
    got = _run(overlapped2, requests)
    assert got["a"][:3] == want["a"][:3] and want["a"][2] == "stop"
    assert got["b"][:3] == want["b"][:3] and want["b"][2] == "stop"
    assert len(want["a"][0]) <= 5
    assert {"a", "b"} <= carried.ids  # their rows were carried, and the extra row was dropped


def test_rows_that_need_the_token_on_the_host_wait_and_still_match() -> None:
    plain, overlapped = _engines()
    requests = {
        "penalty": SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        "freq": SamplingParams(max_tokens=10, temperature=0.8, seed=5, frequency_penalty=0.5, ignore_eos=True),
        "grammar": SamplingParams(max_tokens=20, temperature=0.8, seed=1,
                                  structured=StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}")),
        "plain": SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    }
    want = _run(plain, requests)
    carried = _Carried(overlapped)
    got = _run(overlapped, requests)
    for rid in requests:
        assert got[rid][:3] == want[rid][:3], rid
    assert got["grammar"][2] == "stop"
    assert carried.ids.isdisjoint({"penalty", "freq", "grammar"})
    assert "plain" in carried.ids


def test_abort_with_a_row_scheduled_ahead_frees_everything() -> None:
    _, engine = _engines()
    carried = _Carried(engine)
    engine.add_request("x", _prompt(0), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.add_request("y", _prompt(1), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    seen = 0
    while "x" not in carried.ids or seen < 2:  # x is decoding with a carried row behind its step in flight
        seen += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "x")
    assert engine._in_flight is not None
    assert engine.abort("x")
    after = []
    while engine.has_unfinished():
        after += [o.request_id for o in engine.step()]
    assert "x" not in after and "y" in after
    engine.check_integrity()
    pool = engine.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks


def test_preemption_under_a_small_pool_matches_the_plain_loop() -> None:
    plain, overlapped = _engines(num_blocks=12, max_num_batched_tokens=32)
    requests = {f"r{i}": SamplingParams(max_tokens=14, temperature=0.5, seed=i, ignore_eos=True) for i in range(4)}
    want = _run(plain, requests)
    got = _run(overlapped, requests)
    for rid in requests:
        assert got[rid][:3] == want[rid][:3], rid
