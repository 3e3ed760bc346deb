"""Prefix reuse end to end: results equal with the cache on and off on shared-prefix
workloads, eviction under pressure, cold-prefix leader deferral, aborts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from prelude import SamplingParams
from prelude.engine.request import PoolingParams, PoolingTask

from tests.engine.test_oneshot import run
from tests.engine.tiny import hf_tiny_llama, tiny_engine

pytest.importorskip("transformers")

RUBRIC = list(range(40, 66))  # 26 tokens: 6 full blocks of 4 + 2


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    return hf_tiny_llama()


def items(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [RUBRIC + torch.randint(100, 250, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def workload(prompts: list[list[int]]) -> list[tuple[str, list[int], SamplingParams, PoolingParams | None]]:
    reqs: list[tuple[str, list[int], SamplingParams, PoolingParams | None]] = []
    for i, p in enumerate(prompts):
        reqs.append((f"gen{i}", p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), None))
        reqs.append((f"one{i}", p, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2), None))
        reqs.append((f"plp{i}", p, SamplingParams(max_tokens=0, prompt_logprobs=1), None))
        reqs.append((f"lab{i}", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3))))
        reqs.append((f"emb{i}", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.EMBED, pooling="last")))
    return reqs


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        x, y = a[rid], b[rid]
        assert x.new_token_ids == y.new_token_ids, rid
        for field in ("embedding", "scores"):
            if getattr(x, field) is not None:
                assert torch.allclose(torch.tensor(getattr(x, field)), torch.tensor(getattr(y, field)), atol=1e-4), rid
        if x.prompt_logprobs is not None:
            got = [lp.logprob for lp in x.prompt_logprobs[1:]]
            want = [lp.logprob for lp in y.prompt_logprobs[1:]]
            assert got == pytest.approx(want, abs=1e-4), rid
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.logprob == pytest.approx(ly.logprob, abs=1e-4), rid


def test_same_results_with_cache_on_and_off(hf_model: Any) -> None:
    prompts = items(6, seed=1)
    off = run(tiny_engine(hf_model, prefix_caching=False), workload(prompts))
    engine = tiny_engine(hf_model)
    run(engine, workload(prompts[:1]))  # warm the rubric
    on = run(engine, workload(prompts))
    assert_same({k: v for k, v in on.items()}, off)
    st = engine.kv.stats
    assert st.reused_tokens >= 5 * 24 * 4  # the rubric's full blocks were attached, not recomputed
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


@pytest.mark.parametrize("attention_backend", ["torch", "cpu"])
def test_a_hit_ending_inside_a_block_reuses_those_tokens_with_the_same_results(
        hf_model: Any, attention_backend: str) -> None:
    """RUBRIC is 6 full blocks and 2 tokens: after a first prompt has published its
    blocks, a judged item's OneShot row starts after all 26 rubric tokens (the 2 copied
    from the cached block that holds them), publishes its own copy of that block, and
    answers as with the cache off; a third prompt then hits the second's copy."""
    prompts = [RUBRIC + [200 + i, 150 + i, 100 + 2 * i, 201 - i, 7] for i in range(3)]  # 31 tokens: 7 full blocks
    one = [(f"one{i}", p, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2), None)
           for i, p in enumerate(prompts)]
    lab = [(f"lab{i}", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3)))
           for i, p in enumerate(prompts)]
    off = run(tiny_engine(hf_model, prefix_caching=False, attention_backend=attention_backend), one + lab)
    engine = tiny_engine(hf_model, attention_backend=attention_backend)
    on = run(engine, one[:1])
    for req in one[1:] + lab:
        before = engine.kv.stats.reused_tokens
        on |= run(engine, [req])
        assert engine.kv.stats.reused_tokens - before >= len(RUBRIC), req[0]  # past the last full block
    assert_same(on, off)
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_hits_ending_anywhere_in_a_block_under_eviction_match_the_cache_off(hf_model: Any) -> None:
    """Prompts from three shared prefixes of lengths off the block size, with items of 1-9
    tokens, OneShot requests in waves through a pool small enough to evict: every answer
    equals the cache-off one, partial hits happened, and the pool's books balance."""
    gen = torch.Generator().manual_seed(7)
    rubrics = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (9, 18, 23)]
    prompts = [rubrics[i % 3] + torch.randint(0, 250, (int(torch.randint(1, 10, (1,), generator=gen)),),
                                              generator=gen).tolist() for i in range(30)]
    reqs = [(f"one{i}", p, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2), None) for i, p in enumerate(prompts)]
    reqs += [(f"lab{i}", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3)))
             for i, p in enumerate(prompts)]
    off = run(tiny_engine(hf_model, prefix_caching=False), reqs)
    engine = tiny_engine(hf_model, num_blocks=24)
    copies: list[int] = []
    hold = engine.kv.hold_for_step

    def counting_hold(prefix: list[int], publish: int, copy_from: int | None = None) -> tuple[list[int], int | None]:
        held = hold(prefix, publish, copy_from)
        copies.append(held[1] is not None)
        return held

    engine.kv.hold_for_step = counting_hold  # type: ignore[method-assign]
    on: dict[str, Any] = {}
    for wave in range(0, len(reqs), 7):
        on |= run(engine, reqs[wave : wave + 7])
    assert_same(on, off)
    assert engine.kv.prefix is not None and engine.kv.prefix.num_evicted > 0
    assert sum(copies) >= 10  # hits ending inside a block, their slots copied
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_eviction_under_memory_pressure(hf_model: Any) -> None:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (30,), generator=gen).tolist() for _ in range(12)]
    reqs = [(str(i), p, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), None) for i, p in enumerate(prompts)]
    ref = run(tiny_engine(hf_model, prefix_caching=False), reqs)
    engine = tiny_engine(hf_model, num_blocks=24, max_num_seqs=2)
    got = run(engine, reqs + [(f"again{i}", p, s, q) for i, (_, p, s, q) in enumerate(reqs)])
    assert engine.kv.prefix is not None and engine.kv.prefix.num_evicted > 0
    for i in range(12):
        assert got[str(i)].new_token_ids == ref[str(i)].new_token_ids
        assert got[f"again{i}"].new_token_ids == ref[str(i)].new_token_ids


@pytest.mark.parametrize("mode", ["riders", "deferral", "off"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_cold_burst_computes_the_shared_prefix_once(hf_model: Any, mode: str, backend: str) -> None:
    """riders: the leader and its peers in one forward, the peers reading the prefix blocks
    the leader writes in it; deferral: the peers wait a step and hit the cache; off: every
    request computes the prefix. The tokens are the cache-off engine's in every mode."""
    shared = list(range(10, 42))  # 32 tokens = 8 cold blocks
    prompts = [shared + [200 + i, 201 + i] for i in range(8)]
    reqs = [(str(i), p, SamplingParams(temperature=0.0, max_tokens=1), None) for i, p in enumerate(prompts)]
    engine = tiny_engine(hf_model, max_num_batched_tokens=512, attention_backend=backend)
    engine.scheduler.config = replace(engine.scheduler.config, prefix_deferral=mode != "off",
                                      prefix_riders=mode == "riders")
    for rid, ids, params, _ in reqs:
        engine.add_request(rid, ids, params)
    first = {o.request_id for o in engine.step() if o.finished}
    got = run(engine, [])  # the rest
    ref = run(tiny_engine(hf_model, prefix_caching=False, attention_backend=backend), reqs)
    done = first | set(got)
    assert done == set(ref)
    tokens = {o.request_id: o.new_token_ids for o in ref.values()}
    for rid, out in got.items():
        assert out.new_token_ids == tokens[rid]
    st = engine.kv.stats
    if mode == "riders":
        assert first == set(ref) and not got  # one forward
        assert (st.riders, st.deferred) == (7, 0)
        assert st.computed_tokens == 34 + 7 * 2 and st.reused_tokens == 7 * 32
    elif mode == "deferral":
        assert first == {"0"}
        assert (st.riders, st.deferred) == (0, 7)
        assert st.computed_tokens == 34 + 7 * 2  # the leader's whole prompt, then suffixes only
        assert st.reused_tokens == 7 * 32
    else:
        assert st.computed_tokens == 8 * 34 and st.reused_tokens == 0
    assert engine.kv.prefix is not None and engine.kv.prefix.num_cached_blocks >= 8
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_riders_share_only_the_blocks_equal_to_the_leaders(hf_model: Any) -> None:
    """Peers that share the leader's first cold blocks only, or all of them, or that end
    inside the leader's prefix: each rides on the blocks it has in common and computes (and
    publishes) the rest; a peer with another first block does not ride. Tokens and logprobs
    equal the cache-off engine's, and every hold is released."""
    shared = list(range(10, 42))  # 8 blocks
    prompts = {
        "leader": shared + [200, 201, 202],
        "all": shared + [210, 211],
        "two": shared[:8] + list(range(150, 174)) + [220],  # the first 2 blocks in common
        "inside": shared[:21],  # ends inside the leader's 6th block: 5 shared, 1 token its own
        "other": [99] + shared[1:] + [230],  # another first block: its own prefix
    }
    reqs = [(rid, p, SamplingParams(temperature=0.0, max_tokens=1, logprobs=3), None) for rid, p in prompts.items()]
    engine = tiny_engine(hf_model, max_num_batched_tokens=512, attention_backend="cpu")
    for rid, ids, params, pooling in reqs:
        engine.add_request(rid, ids, params, pooling)
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {rid for rid, *_ in reqs} and all(o.finished for o in outs.values())
    engine.check_integrity()
    ref = run(tiny_engine(hf_model, prefix_caching=False, attention_backend="cpu"), reqs)
    assert_same({k: replace(v, prompt_logprobs=None) for k, v in outs.items()},
                {k: replace(v, prompt_logprobs=None) for k, v in ref.items()})
    st = engine.kv.stats
    assert st.riders == 3  # all, two, inside
    assert st.reused_tokens == (8 + 2 + 5) * 4
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_aborts_release_attached_prefixes(hf_model: Any) -> None:
    engine = tiny_engine(hf_model)
    run(engine, workload(items(1, seed=3)))
    for i, p in enumerate(items(6, seed=4)):
        engine.add_request(f"d{i}", p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        engine.add_request(f"o{i}", p, SamplingParams(max_tokens=1))
    engine.step()
    engine.step()
    for i in range(6):
        engine.abort(f"d{i}")
        engine.abort(f"o{i}")
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks
