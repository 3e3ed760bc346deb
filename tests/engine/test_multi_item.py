"""Decision heads vs HF transformers (float32, random tiny Llama and Qwen3): label rows
gathered from the LM head, multi-item scoring packed into one OneShot row, whole-label
sequence logprobs; with the prefix cache on."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prelude import SamplingParams
from prelude.engine.engine import LLMEngine
from prelude.engine.request import PoolingParams, PoolingTask, RequestOutput
from prelude.forward_batch import OneShotBatch

from tests.engine.tiny import EOS, VOCAB, hf_tiny_llama, tiny_engine

transformers = pytest.importorskip("transformers")

NO_GEN = SamplingParams(max_tokens=0)
TOL = 1e-4


def hf_tiny_qwen3(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=1000000.0,
        eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=False,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # random init leaves norms at 1: perturb them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf_model(request: pytest.FixtureRequest) -> Any:
    return hf_tiny_llama() if request.param == "llama" else hf_tiny_qwen3()


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """[n, V] next-token log-probabilities at every position of `ids`."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: LLMEngine, requests: list[tuple[str, list[int], PoolingParams]]) -> dict[str, RequestOutput]:
    for rid, ids, pooling in requests:
        engine.add_request(rid, ids, NO_GEN, pooling)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    engine.check_integrity()
    return finals


LABELS = (3, 7, 200, 65)


def test_gathered_label_rows_match_full_log_softmax(hf_model: Any) -> None:
    engine = tiny_engine(hf_model)
    prompt = tokens(23, seed=1)
    outs = run(engine, [
        ("full", prompt, PoolingParams(PoolingTask.LABELS, label_token_ids=LABELS)),
        ("gathered", prompt, PoolingParams(PoolingTask.LABELS, label_token_ids=LABELS, label_softmax=True)),
    ])
    ref = hf_logprobs(hf_model, prompt)[-1, list(LABELS)]
    full = torch.tensor(outs["full"].scores)
    gathered = torch.tensor(outs["gathered"].scores)
    assert (full - ref).abs().max() < TOL
    # A softmax restricted to the labels is the full one renormalized over them.
    assert (gathered - torch.log_softmax(ref, dim=0)).abs().max() < TOL


def test_gathered_head_projects_only_the_label_rows(hf_model: Any) -> None:
    engine = tiny_engine(hf_model)
    calls: list[int] = []
    model = engine.runner.model
    original = model.compute_logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return original(hidden)

    model.compute_logits = counting  # type: ignore[method-assign]
    try:
        run(engine, [("g", tokens(9, 2), PoolingParams(PoolingTask.LABELS, label_token_ids=LABELS, label_softmax=True,
                                                      item_lens=(3, 4)))])
    finally:
        model.compute_logits = original  # type: ignore[method-assign]
    assert calls == []


@pytest.mark.parametrize("label_softmax", [False, True])
def test_multi_item_row_equals_items_alone(hf_model: Any, label_softmax: bool) -> None:
    """Query + N items in one row == N separate query+item prompts (and HF on each)."""
    engine = tiny_engine(hf_model, block_size=4, max_num_batched_tokens=512)
    query = tokens(18, seed=3)  # not a multiple of the block size: a partial shared block
    items = [tokens(n, seed=10 + n) for n in (1, 5, 8, 3)]
    packed = PoolingParams(PoolingTask.LABELS, label_token_ids=LABELS, label_softmax=label_softmax,
                           item_lens=tuple(len(i) for i in items))
    single = PoolingParams(PoolingTask.LABELS, label_token_ids=LABELS, label_softmax=label_softmax)
    cold = run(engine, [("packed", query + [t for i in items for t in i], packed)])
    # Second time the query is a prefix-cache hit; separate requests hit it as well.
    warm = run(engine, [("packed2", query + [t for i in items for t in i], packed)]
               + [(f"alone{j}", query + item, single) for j, item in enumerate(items)])
    assert engine.kv.stats.hits >= 1
    k = len(LABELS)
    for j, item in enumerate(items):
        ref = hf_logprobs(hf_model, query + item)[-1, list(LABELS)]
        if label_softmax:
            ref = torch.log_softmax(ref, dim=0)
        for name, outs in (("packed", cold), ("packed2", warm)):
            got = torch.tensor(outs[name].scores[j * k : (j + 1) * k])
            assert (got - ref).abs().max() < TOL, (name, j)
        alone = torch.tensor(warm[f"alone{j}"].scores)
        assert (alone - ref).abs().max() < TOL


def test_multi_item_rows_batched_with_plain_rows(hf_model: Any) -> None:
    """Segmented and plain rows in one OneShot forward, the query fully cached (a multiple
    of the block size) on the second pass."""
    engine = tiny_engine(hf_model, block_size=4, max_num_batched_tokens=512, prefix_caching=True)
    query = tokens(16, seed=4)
    items = [tokens(4, seed=20), tokens(6, seed=21)]
    packed = PoolingParams(PoolingTask.LABELS, label_token_ids=LABELS, item_lens=(4, 6))
    plain = PoolingParams(PoolingTask.LABELS, label_token_ids=LABELS)
    other = tokens(11, seed=5)
    batches: list[int] = []
    launch = engine.runner.launch

    def spy(batch: Any, *rest: Any) -> Any:
        if isinstance(batch, OneShotBatch):
            batches.append(len(batch.rows))
        return launch(batch, *rest)

    engine.runner.launch = spy  # type: ignore[method-assign]
    for rnd in range(2):
        outs = run(engine, [(f"p{rnd}", query + items[0] + items[1], packed), (f"o{rnd}", other, plain)])
        for j, item in enumerate(items):
            ref = hf_logprobs(hf_model, query + item)[-1, list(LABELS)]
            got = torch.tensor(outs[f"p{rnd}"].scores[j * 4 : (j + 1) * 4])
            assert (got - ref).abs().max() < TOL
        ref_other = hf_logprobs(hf_model, other)[-1, list(LABELS)]
        assert (torch.tensor(outs[f"o{rnd}"].scores) - ref_other).abs().max() < TOL
    assert max(batches) == 2  # the packed and the plain row shared a forward


def test_whole_label_sequence_logprobs_match_teacher_forcing(hf_model: Any) -> None:
    """Labels sharing first tokens, 1 to 4 tokens long: sum of each label's token logprobs
    after the prompt, K labels in one row == K teacher-forced HF forwards."""
    engine = tiny_engine(hf_model, block_size=4, max_num_batched_tokens=512)
    prompt = tokens(13, seed=6)
    labels = [[40, 41], [40, 42, 43], [40], [99, 98, 97, 96]]
    pooling = PoolingParams(PoolingTask.SEQUENCE_LOGPROBS, item_lens=tuple(len(x) for x in labels))
    for rnd in range(2):  # cold, then with the prompt's blocks cached
        outs = run(engine, [(f"s{rnd}", prompt + [t for x in labels for t in x], pooling)])
        got = torch.tensor(outs[f"s{rnd}"].scores)
        for j, label in enumerate(labels):
            lp = hf_logprobs(hf_model, prompt + label)
            ref = sum(lp[len(prompt) - 1 + t, label[t]] for t in range(len(label)))
            assert abs(float(got[j]) - float(ref)) < TOL, (rnd, j)


def test_packed_items_are_always_oneshot_and_need_a_shared_part(hf_model: Any) -> None:
    from prelude.engine.client import InvalidRequestError
    from prelude.engine.request import ExecClass

    forced = tiny_engine(hf_model, force_paged=True)
    pooling = PoolingParams(PoolingTask.LABELS, label_token_ids=LABELS, item_lens=(2,))
    assert forced.prepare("a", [1, 2, 3], NO_GEN, pooling).exec_class is ExecClass.ONESHOT
    with pytest.raises(InvalidRequestError):
        forced.prepare("b", [1, 2], NO_GEN, pooling)
