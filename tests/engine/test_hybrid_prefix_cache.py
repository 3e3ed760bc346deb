"""Prefix caching of a hybrid model with recurrent-state checkpoints: a hit restores the
cached K/V and the state at the prefix's end and computes the suffix only, giving what a
cold run (and transformers) gives; OneShot followers of a leader hit token-exact; evicted
blocks take their checkpoints with them; aborts and failed steps leave nothing held."""

from __future__ import annotations

from typing import Any

import pytest

from prelude.engine.errors import StepFailed
from prelude.engine.engine import LLMEngine
from prelude.params import SamplingParams
from tests.engine.test_hybrid_engine import hf_greedy, hf_model, make_engine  # noqa: F401 (fixtures)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
ONE = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
RUBRIC = [(7 * i) % 200 + 3 for i in range(21)]  # 5 blocks of 4 and one token


def run(engine: LLMEngine, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, tuple[list[int], list]]:
    """Every request to its end, checking the bookkeeping each step; tokens and logprobs."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    out: dict[str, tuple[list[int], list]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, lps = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.new_token_ids)
            lps.extend(o.logprobs or [])
        engine.check_integrity()
    return out


def assert_same(warm: dict, cold: dict) -> None:
    assert warm.keys() == cold.keys()
    for rid in cold:
        assert warm[rid][0] == cold[rid][0], rid
        for a, b in zip(warm[rid][1], cold[rid][1], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, rid


def checkpoints_idle(engine: LLMEngine) -> None:
    """No checkpoint held: each is free or cached."""
    ck = engine.kv.checkpoints
    assert ck is not None and engine.kv.prefix is not None
    assert ck.num_free_slots + engine.kv.prefix.num_checkpoints == engine.num_checkpoint_slots


@pytest.mark.parametrize("engine_kw", [dict(), dict(max_num_batched_tokens=8)], ids=["whole", "chunked"])
def test_decode_after_a_cached_prefix_equals_a_cold_decode(hf_model: Any, make_engine: Any,
                                                           engine_kw: dict[str, Any]) -> None:
    warm = make_engine(state_checkpoint_stride=8, **engine_kw)
    cold = make_engine(prefix_caching=False, **engine_kw)
    twelve = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    first = [("a", RUBRIC + [9, 9, 9, 9], twelve)]
    cold_a = run(cold, first)
    assert_same(run(warm, first), cold_a)
    assert warm.kv.prefix is not None and warm.kv.prefix.num_checkpoints >= 4  # at 8, 16, 24 and 32
    # prefixes ending at the stride's checkpoints, the last (32) one a decode row wrote
    prefix_lens = {"p8": 8, "p16": 16, "p24": 24, "p32": 32}
    seq_a = RUBRIC + [9, 9, 9, 9] + cold_a["a"][0]
    later = [(rid, seq_a[:n] + [50 + n, 51, 52], GREEDY) for rid, n in prefix_lens.items()]
    for req in later:
        reused = warm.kv.stats.reused_tokens
        got = run(warm, [req])
        assert_same(got, run(cold, [req]))
        assert got[req[0]][0] == hf_greedy(hf_model, req[1], 6)
        assert warm.kv.stats.reused_tokens - reused == prefix_lens[req[0]]  # the hit: up to the checkpoint
    checkpoints_idle(warm)


def test_a_hit_uses_the_longest_prefix_that_ends_at_a_checkpoint(make_engine: Any) -> None:
    warm = make_engine(state_checkpoint_stride=8)
    run(warm, [("a", RUBRIC, GREEDY)])  # checkpoints at 8 and 16
    reused = warm.kv.stats.reused_tokens
    out = run(warm, [("b", RUBRIC[:14] + [1, 2], GREEDY)])  # K/V cached up to 14, state at 8
    assert warm.kv.stats.reused_tokens - reused == 8
    assert_same(out, run(make_engine(prefix_caching=False), [("b", RUBRIC[:14] + [1, 2], GREEDY)]))
    # that row kept a checkpoint where its prompt parts from the cached one: the next hits there
    reused = warm.kv.stats.reused_tokens
    run(warm, [("c", RUBRIC[:14] + [3, 4, 5, 6], ONE)])
    assert warm.kv.stats.reused_tokens - reused == 14


@pytest.mark.parametrize("rubric_len", [21, 16, 3], ids=["mid-block", "block-end", "short"])
def test_oneshot_followers_hit_token_exact_and_answer_as_cold(hf_model: Any, make_engine: Any,
                                                              rubric_len: int) -> None:
    warm = make_engine()  # the stride (512) is longer than every prompt here
    cold = make_engine(prefix_caching=False)
    rubric = RUBRIC[:rubric_len]
    wave = [(f"j{i}", rubric + [100 + i, 7, 30 + i, 8], ONE) for i in range(8)]
    got = run(warm, wave)
    assert_same(got, run(cold, wave))
    for rid, prompt, _ in wave[:3]:
        assert got[rid][0] == hf_greedy(hf_model, prompt, 1)
    if rubric_len >= warm.block_size:
        # the leader kept a checkpoint where its deferred peers part: each follower hits there
        assert warm.kv.stats.deferred == 7 and warm.kv.stats.reused_tokens == 7 * rubric_len
    later = [(f"k{i}", rubric + [120 + i, 7, 9], ONE) for i in range(4)]
    reused = warm.kv.stats.reused_tokens
    for req in later:  # one by one: the first keeps a checkpoint where it parts from the cached prompts
        assert_same(run(warm, [req]), run(cold, [req]))
    # a short rubric (inside the first block) hits from the second of these on at the latest
    assert warm.kv.stats.reused_tokens - reused >= (3 if rubric_len < warm.block_size else 4) * rubric_len
    checkpoints_idle(warm)


def test_multi_item_scoring_hits_the_shared_part(make_engine: Any) -> None:
    from prelude.engine.request import PoolingParams, PoolingTask

    warm = make_engine()
    cold = make_engine(prefix_caching=False)

    def scores(engine: LLMEngine, i: int) -> list[float]:
        pooling = PoolingParams(PoolingTask.LABELS, label_token_ids=(5, 6), item_lens=(3, 2))
        engine.add_request(f"s{i}", RUBRIC + [60 + i, 61, 62, 70, 71], SamplingParams(max_tokens=0), pooling)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        engine.check_integrity()
        return list(outs[-1].scores)

    for i in range(4):
        a, b = scores(warm, i), scores(cold, i)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    # the second keeps a checkpoint where it parts from the first (20 of the shared part's 21
    # tokens: a hit leaves the last one to compute), the third and fourth hit there
    assert warm.kv.stats.reused_tokens == 2 * 20


def test_evicted_blocks_take_their_checkpoints(make_engine: Any) -> None:
    engine = make_engine(num_blocks=24, state_checkpoint_stride=4, max_state_checkpoints=3)
    prompts = [[200 + i] + RUBRIC[: 12 + i] for i in range(6)]
    for i, p in enumerate(prompts):
        run(engine, [(f"r{i}", p, ONE)])
        assert engine.kv.prefix is not None and engine.kv.prefix.num_checkpoints <= 3
        checkpoints_idle(engine)
    assert engine.kv.checkpoints is not None and engine.kv.checkpoints.num_evicted > 0  # the LRU made room
    engine.kv.prefix.evict(engine.kv.pool.num_blocks)  # every cached block goes: so do the checkpoints
    assert engine.kv.prefix.num_checkpoints == 0 and engine.kv.checkpoints.num_free_slots == 3
    engine.check_integrity()
    # and a long request pushes the cache out through the pool's own LRU as well
    run(engine, [("p", RUBRIC + [5], ONE)])
    run(engine, [("long", list(range(10, 10 + 90)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))])
    checkpoints_idle(engine)


def test_aborts_and_failed_steps_leave_no_checkpoint_held(make_engine: Any) -> None:
    engine = make_engine(state_checkpoint_stride=8, max_num_batched_tokens=8)
    run(engine, [("a", RUBRIC + [1, 2, 3], ONE)])
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(3):  # hits that pin a checkpoint until their first row runs
        engine.add_request(f"h{i}", RUBRIC[:17] + [i, 40], long)
    engine.step()
    engine.abort("h0")
    engine.step()
    engine.abort("h1")
    engine.check_integrity()
    real = engine.runner.launch

    def boom(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("simulated out of memory")

    engine.add_request("o", RUBRIC + [7, 7], ONE)  # a OneShot hit restoring a checkpoint
    engine.add_request("p", RUBRIC[:16] + [8, 8, 8, 8, 8, 8, 8, 8, 8], long)  # a paged row saving one
    engine.runner.launch = boom  # type: ignore[method-assign]
    with pytest.raises(StepFailed):
        engine.step()
    engine.runner.launch = real  # type: ignore[method-assign]
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    checkpoints_idle(engine)


def test_a_chat_prompt_hits_a_prefix_shorter_than_a_block(hf_model: Any, make_engine: Any) -> None:
    warm = make_engine()
    cold = make_engine(prefix_caching=False)
    short = RUBRIC[:3]  # inside the first block (of 4)
    run(warm, [("s1", short + [50, 51, 52, 53, 54], ONE)])
    run(warm, [("s2", short + [60, 61, 62, 63], ONE)])  # parts from s1 at 3: keeps a checkpoint there
    for rid, tail in (("c1", [70, 71, 72]), ("c2", [80])):
        reused = warm.kv.stats.reused_tokens
        req = [(rid, short + tail, GREEDY)]
        got = run(warm, req)
        assert warm.kv.stats.reused_tokens - reused == 3  # K/V copied from the cached block, the state restored
        assert_same(got, run(cold, req))
        assert got[rid][0] == hf_greedy(hf_model, short + tail, 6)
    checkpoints_idle(warm)
