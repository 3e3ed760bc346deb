"""Execution classes: OneShot work keeps no decode-shaped state and gives the same
answers as the Paged path and as HF transformers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from prelude import SamplingParams
from prelude.forward_batch import OneShotBatch
from prelude.engine.engine import LLMEngine
from prelude.engine.request import ExecClass, PoolingParams, PoolingTask, RequestOutput

from tests.engine.tiny import hf_tiny_llama, tiny_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    return hf_tiny_llama()


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, PoolingParams | None]]) -> dict[str, RequestOutput]:
    for rid, ids, params, pooling in requests:
        engine.add_request(rid, ids, params, pooling)
    finals: dict[str, RequestOutput] = {}
    prompt_lps: dict[str, Any] = {}
    tokens: dict[str, tuple[int, ...]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, ()) + out.new_token_ids
            if out.prompt_logprobs is not None:  # sent with a request's first increment
                prompt_lps[out.request_id] = out.prompt_logprobs
            if out.finished:
                finals[out.request_id] = replace(
                    out, prompt_logprobs=prompt_lps.get(out.request_id), new_token_ids=tokens[out.request_id]
                )
    engine.check_integrity()
    return finals


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_admission_classes(hf_model: Any) -> None:
    engine = tiny_engine(hf_model)
    assert engine.prepare("a", [1, 2], SamplingParams(max_tokens=1)).exec_class is ExecClass.ONESHOT
    assert engine.prepare("b", [1, 2], SamplingParams(max_tokens=0, prompt_logprobs=1)).exec_class is ExecClass.ONESHOT
    pooled = engine.prepare("c", [1, 2], SamplingParams(max_tokens=0), PoolingParams(PoolingTask.EMBED))
    assert pooled.exec_class is ExecClass.ONESHOT
    assert engine.prepare("d", [1, 2], SamplingParams(max_tokens=2)).exec_class is ExecClass.PAGED
    forced = tiny_engine(hf_model, force_paged=True)
    assert forced.prepare("e", [1, 2], SamplingParams(max_tokens=1)).exec_class is ExecClass.PAGED


def _held_kv(engine: LLMEngine) -> list[torch.Tensor]:
    """Copies of the KV of every block a request holds (the running decodes')."""
    held = sorted({b for table in engine.kv.holders().values() for b in table})
    index = torch.tensor(held, dtype=torch.long)
    return [t[index].clone() for layer in engine.runner.kv_caches for t in layer]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "default-cache"])
def test_oneshot_burst_leaves_the_block_pool_untouched(hf_model: Any, prefix_caching: bool) -> None:
    """OneShot traffic next to running decodes. Without the prefix cache the pool state is
    identical step by step; with it (the default) a OneShot step may only add cached,
    unreferenced blocks (its published prompt blocks): no request's blocks change, and
    the KV of every block a decode holds is bit-identical."""
    engine = tiny_engine(hf_model, num_blocks=64, prefix_caching=prefix_caching, fuse_oneshot=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=1)):
        engine.add_request(f"d{i}", p, greedy)
    engine.step()  # decodes are running and hold their blocks
    burst = prompts(40, seed=2)
    for i, p in enumerate(burst):
        kind = i % 4
        if kind == 0:
            engine.add_request(f"g{i}", p, SamplingParams(max_tokens=1))
        elif kind == 1:
            engine.add_request(f"l{i}", p, SamplingParams(max_tokens=0, prompt_logprobs=2))
        elif kind == 2:
            engine.add_request(f"e{i}", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.EMBED, pooling="mean"))
        else:
            engine.add_request(f"c{i}", p, SamplingParams(max_tokens=0),
                               PoolingParams(PoolingTask.LABELS, label_token_ids=(5, 6, 7)))
    kinds: set[type] = set()
    done = 0
    while engine.has_unfinished():
        pool = engine.kv.pool
        before = (list(pool._free), list(pool._ref_counts), {k: list(v) for k, v in engine.kv.holders().items()})
        kv_before = _held_kv(engine)
        plan_is_oneshot = bool(engine.scheduler.oneshot_waiting) and not engine.scheduler._last_was_oneshot
        outs = engine.step()
        done += sum(o.finished for o in outs)
        if plan_is_oneshot:
            after = (list(pool._free), list(pool._ref_counts), {k: list(v) for k, v in engine.kv.holders().items()})
            if not prefix_caching:
                assert after == before  # a OneShot step allocates, frees and writes nothing
            else:
                assert after[1] == before[1] and after[2] == before[2]  # no reference kept, no table touched
                taken = set(before[0]) - set(after[0])
                assert all(pool.is_cached(b) and pool.ref_count(b) == 0 for b in taken)
                assert pool.num_evictable_blocks >= len(taken)
            for a, b in zip(kv_before, _held_kv(engine), strict=True):
                assert torch.equal(a, b)  # the decodes' KV is untouched
            kinds.add(OneShotBatch)
        engine.check_integrity()
    assert done == 43 and OneShotBatch in kinds
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks  # every block free or cached
    if not prefix_caching:
        assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_oneshot_generation_equals_decode_path(hf_model: Any) -> None:
    ps = prompts(6, seed=3)
    reqs = [(str(i), p, SamplingParams(temperature=0.0, max_tokens=1, logprobs=3), None) for i, p in enumerate(ps)]
    oneshot = run(tiny_engine(hf_model), reqs)
    forced = run(tiny_engine(hf_model, force_paged=True), reqs)
    for i, p in enumerate(ps):
        a, b = oneshot[str(i)], forced[str(i)]
        assert a.new_token_ids == b.new_token_ids and a.text == b.text
        assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=1e-5)
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0, -1]
        assert a.new_token_ids[0] == int(ref.argmax())
        assert a.finish_reason is not None and a.finish_reason.value == "length"


@pytest.mark.parametrize("force_paged", [False, True], ids=["oneshot", "forced-paged"])
def test_prompt_logprobs_match_hf(hf_model: Any, force_paged: bool) -> None:
    ps = prompts(5, seed=4)
    reqs = [(str(i), p, SamplingParams(max_tokens=0, prompt_logprobs=3), None) for i, p in enumerate(ps)]
    reqs.append(("gen", ps[0], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, ignore_eos=True), None))
    outs = run(tiny_engine(hf_model, max_num_batched_tokens=16, force_paged=force_paged), reqs)
    for rid, p in [(str(i), p) for i, p in enumerate(ps)] + [("gen", ps[0])]:
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), -1)
        lps = outs[rid].prompt_logprobs
        assert lps is not None and len(lps) == len(p) and lps[0] is None
        for j in range(1, len(p)):
            lp = lps[j]
            assert lp is not None and lp.token_id == p[j]
            assert abs(lp.logprob - ref[j - 1, p[j]].item()) <= 1e-4
            assert lp.rank == int((ref[j - 1] > ref[j - 1, p[j]]).sum()) + 1
            if rid != "gen":
                assert [t for t, _ in lp.top] == ref[j - 1].topk(3).indices.tolist()
    assert len(outs["gen"].new_token_ids) == 4


def test_pooling_and_label_scores_match_hf(hf_model: Any) -> None:
    ps = prompts(4, seed=5)
    labels = (10, 20, 30)
    reqs: list[tuple[str, list[int], SamplingParams, PoolingParams | None]] = []
    for i, p in enumerate(ps):
        reqs.append((f"last{i}", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.EMBED, pooling="last")))
        reqs.append((f"mean{i}", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.EMBED, pooling="mean", normalize=True)))
        reqs.append((f"lab{i}", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.LABELS, label_token_ids=labels)))
    outs = run(tiny_engine(hf_model), reqs)
    for i, p in enumerate(ps):
        with torch.no_grad():
            res = hf_model(torch.tensor([p]), output_hidden_states=True)
        hidden = res.hidden_states[-1][0]
        assert torch.allclose(torch.tensor(outs[f"last{i}"].embedding), hidden[-1], atol=1e-4)
        mean = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        assert torch.allclose(torch.tensor(outs[f"mean{i}"].embedding), mean, atol=1e-4)
        ref = torch.log_softmax(res.logits[0, -1].float(), -1)[list(labels)]
        assert torch.allclose(torch.tensor(outs[f"lab{i}"].scores), ref, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sequence_classification_head_matches_hf(kind: str) -> None:
    torch.manual_seed(0)
    common = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        hf = transformers.LlamaForSequenceClassification(cfg).eval()
    else:
        cfg = transformers.Qwen2Config(**common)
        hf = transformers.Qwen2ForSequenceClassification(cfg).eval()
    hf.config.architectures = [type(hf).__name__]
    hf.config.id2label = {0: "neg", 1: "neu", 2: "pos"}
    engine = tiny_engine(hf)
    assert engine.labels == ("neg", "neu", "pos") and not engine.can_generate
    ps = [p for p in prompts(4, seed=6)]
    outs = run(engine, [(str(i), [t + 1 for t in p], SamplingParams(max_tokens=0), PoolingParams(PoolingTask.CLASSIFY))
                        for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        with torch.no_grad():
            ref = hf(torch.tensor([[t + 1 for t in p]])).logits[0]
        assert torch.allclose(torch.tensor(outs[str(i)].scores), ref, atol=1e-4)
    from prelude.engine.client import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        engine.prepare("gen", [1, 2], SamplingParams(max_tokens=3))


def test_oneshot_abort_and_ablation_pooling(hf_model: Any) -> None:
    engine = tiny_engine(hf_model)
    for i, p in enumerate(prompts(5, seed=7)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=1))
    assert engine.abort("0") and engine.abort("3")
    outs = {o.request_id for o in engine.step()}
    assert outs == {"1", "2", "4"}
    engine.check_integrity()
    forced = tiny_engine(hf_model, force_paged=True)
    p = prompts(1, seed=8)[0]
    emb = run(forced, [("e", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.EMBED, pooling="mean"))])
    ref = run(tiny_engine(hf_model), [("e", p, SamplingParams(max_tokens=0), PoolingParams(PoolingTask.EMBED, pooling="mean"))])
    assert torch.allclose(torch.tensor(emb["e"].embedding), torch.tensor(ref["e"].embedding), atol=1e-5)
    assert forced.kv.num_available_blocks == forced.kv.pool.num_blocks
