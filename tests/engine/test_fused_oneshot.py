"""Fused steps: OneShot rows riding in the Decode/Mixed forward give exactly their answers
alone, leave the decodes' tokens unchanged, own no KV and no block table, and the block
pool's books stay whole (float32, tiny random Llama)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prelude import SamplingParams
from prelude.engine.engine import LLMEngine
from prelude.engine.request import ExecClass, PoolingParams, PoolingTask, RequestOutput
from prelude.forward_batch import ForwardBatch, MixedBatch, OneShotBatch

from tests.engine.tiny import hf_tiny_llama, tiny_engine

pytest.importorskip("transformers")

TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
Spec = tuple[str, list[int], SamplingParams, PoolingParams | None]


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return hf_tiny_llama()


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_requests() -> list[Spec]:
    return [(f"d{i}", toks(5 + 3 * i, seed=i), GREEDY, None) for i in range(3)]


def oneshot_requests() -> list[Spec]:
    """One of every OneShot output: a sampled token with logprobs, prompt logprobs, pooled
    vectors, label scores, multi-item label scores and whole-label sequence logprobs."""
    q = toks(12, seed=50)  # a shared query: the second user hits its cached blocks
    no_gen = SamplingParams(max_tokens=0)
    return [
        ("g", toks(9, 10), SamplingParams(temperature=0.0, max_tokens=1, logprobs=3), None),
        ("pl", toks(11, 11), SamplingParams(max_tokens=0, prompt_logprobs=2), None),
        ("em", toks(7, 12), no_gen, PoolingParams(PoolingTask.EMBED, pooling="mean", normalize=True)),
        ("el", toks(13, 13), no_gen, PoolingParams(PoolingTask.EMBED, pooling="last")),
        ("lab", q + toks(3, 14), no_gen, PoolingParams(PoolingTask.LABELS, label_token_ids=(5, 6, 7))),
        ("mi", q + toks(6, 15), no_gen,
         PoolingParams(PoolingTask.LABELS, label_token_ids=(5, 6, 7), item_lens=(2, 3, 1))),
        ("seq", toks(10, 16) + toks(5, 17), no_gen, PoolingParams(PoolingTask.SEQUENCE_LOGPROBS, item_lens=(1, 3, 1))),
    ]


def spy_batches(engine: LLMEngine) -> list[ForwardBatch]:
    seen: list[ForwardBatch] = []
    launch = engine.runner.launch

    def spy(batch: ForwardBatch, *rest: Any) -> Any:
        seen.append(batch)
        return launch(batch, *rest)

    engine.runner.launch = spy  # type: ignore[method-assign]
    return seen


def drain(engine: LLMEngine, finals: dict[str, RequestOutput], tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.request_id] = out
    engine.check_integrity()
    # only Paged requests ever hold blocks (OneShot rows own no table)
    assert all(engine._requests[rid].exec_class is ExecClass.PAGED for rid in engine.kv.holders())


def close(a: Any, b: Any) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=TOL, rtol=TOL)


def assert_same_answer(a: RequestOutput, b: RequestOutput) -> None:
    assert a.new_token_ids == b.new_token_ids
    close(a.embedding, b.embedding)
    close(a.scores, b.scores)
    for x, y in ((a.logprobs, b.logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
        assert (x is None) == (y is None)
        for p, q in zip(x or (), y or (), strict=True):
            assert (p is None) == (q is None)
            if p is not None:
                assert p.token_id == q.token_id and [t for t, _ in p.top] == [t for t, _ in q.top]
                assert abs(p.logprob - q.logprob) <= TOL


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_fused_oneshot_rows_equal_alone_and_decodes_unchanged(hf_model: Any, prefix_caching: bool) -> None:
    """Decodes run in a fused engine next to a OneShot burst and, step for step, in a twin
    engine with the decodes only. The decodes' tokens, block tables and KV stay the twin's;
    no OneShot request ever holds a block; without the prefix cache the pool's free list is
    the twin's at every step (OneShot rows write nothing), with it OneShot rows only add
    cached, unreferenced blocks. Each OneShot answer equals that request run alone."""
    fused = tiny_engine(hf_model, prefix_caching=prefix_caching)
    twin = tiny_engine(hf_model, prefix_caching=prefix_caching)
    batches = spy_batches(fused)
    for engine in (fused, twin):
        for rid, ids, params, pooling in decode_requests():
            engine.add_request(rid, ids, params, pooling)
    fin_f: dict[str, RequestOutput] = {}
    fin_t: dict[str, RequestOutput] = {}
    tok_f: dict[str, list[int]] = {}
    tok_t: dict[str, list[int]] = {}
    drain(fused, fin_f, tok_f)
    drain(twin, fin_t, tok_t)  # prompts done: both are decoding
    for rid, ids, params, pooling in oneshot_requests() + [(f"x{i}", toks(8, 60 + i), SamplingParams(max_tokens=1),
                                                            None) for i in range(6)]:
        fused.add_request(rid, ids, params, pooling)
    while twin.has_unfinished():
        drain(fused, fin_f, tok_f)
        drain(twin, fin_t, tok_t)
        assert fused.kv.holders().keys() == twin.kv.holders().keys()
        for rid, table in twin.kv.holders().items():
            mine = fused.kv.holders()[rid]
            assert len(mine) == len(table)
            n = fused._requests[rid].num_computed_tokens if rid in fused._requests else 0
            for layer_f, layer_t in zip(fused.runner.kv_caches, twin.runner.kv_caches, strict=True):
                for cache_f, cache_t in zip(layer_f, layer_t, strict=True):
                    kv_f = cache_f[torch.tensor(mine)].flatten(0, 1)[:n]
                    kv_t = cache_t[torch.tensor(table)].flatten(0, 1)[:n]
                    torch.testing.assert_close(kv_f, kv_t, atol=1e-5, rtol=1e-5)
        if not prefix_caching:
            assert sorted(fused.kv.pool._free) == sorted(twin.kv.pool._free)
            assert fused.kv.holders() == twin.kv.holders()
    while fused.has_unfinished():
        drain(fused, fin_f, tok_f)
    assert {rid: tok_f[rid] for rid in tok_t} == tok_t  # greedy decode tokens unchanged
    fused_steps = [b for b in batches if isinstance(b, MixedBatch) and b.oneshot_rows and b.decode_rows]
    assert fused_steps and not any(isinstance(b, OneShotBatch) for b in batches[: len(fused_steps)])
    assert fused.kv.num_available_blocks == fused.kv.pool.num_blocks  # every block free or cached
    if not prefix_caching:
        assert fused.kv.num_free_blocks == fused.kv.pool.num_blocks
    alone = tiny_engine(hf_model, prefix_caching=prefix_caching)
    for rid, ids, params, pooling in oneshot_requests():
        alone.add_request(rid, ids, params, pooling)
        fin_a: dict[str, RequestOutput] = {}
        while alone.has_unfinished():
            drain(alone, fin_a, {})
        assert_same_answer(fin_f[rid], fin_a[rid])


def test_fused_with_prompt_chunks_and_turns(hf_model: Any) -> None:
    """Paged prompt chunks, decodes and OneShot rows share fused steps under a small token
    budget; OneShot and paged prompts take turns at going first, so neither starves, and
    every answer equals the alternating engine's."""
    reqs: list[Spec] = [(f"d{i}", toks(30, seed=70 + i), GREEDY, None) for i in range(4)]
    reqs += [(f"o{i}", toks(20, seed=80 + i), SamplingParams(max_tokens=0),
              PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2))) for i in range(8)]
    answers = []
    for fuse in (True, False):
        engine = tiny_engine(hf_model, max_num_batched_tokens=32, fuse_oneshot=fuse)
        batches = spy_batches(engine)
        for rid, ids, params, pooling in reqs:
            engine.add_request(rid, ids, params, pooling)
        finals: dict[str, RequestOutput] = {}
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            drain(engine, finals, tokens)
        assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks
        fused = [b for b in batches if isinstance(b, MixedBatch) and b.oneshot_rows]
        assert bool(fused) == fuse
        if fuse:  # some fused steps hold prompt chunks and OneShot rows side by side
            assert any(b.prefill_rows for b in fused)
        answers.append((finals, tokens))
    (f_fin, f_tok), (a_fin, a_tok) = answers
    assert f_tok == a_tok
    for rid in f_fin:
        assert_same_answer(f_fin[rid], a_fin[rid])
