"""Causal pooled models on the prefix cache: last-token embeddings, classify/reward heads and
label scores look up and publish shared prefixes (an instruction, a conversation) like a
one-token judge, and run in chunks when longer than a step; the answers equal cold runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prelude import SamplingParams
from prelude.engine.request import PoolingParams, PoolingTask

from tests.engine.test_oneshot import run
from tests.engine.tiny import EOS, VOCAB, hf_tiny_qwen3, tiny_engine

transformers = pytest.importorskip("transformers")

INSTRUCTION = list(b"Instruct: Given a web search query, retrieve relevant passages\nQuery: ")  # 66 tokens
NO_GEN = SamplingParams(max_tokens=0)


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return hf_tiny_qwen3(VOCAB)


@pytest.fixture(scope="module")
def reward_model() -> Any:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1,
                                   pad_token_id=EOS, architectures=["Qwen3ForSequenceClassification"])
    return transformers.Qwen3ForSequenceClassification(cfg).float().eval()


def _texts(n: int) -> list[list[int]]:
    return [INSTRUCTION + list(f"text number {i} about {'cats' if i % 2 else 'the capital of france'}".encode())
            for i in range(n)]


def _embed(i: int, ids: list[int]) -> tuple[str, list[int], SamplingParams, PoolingParams]:
    return (f"e{i}", ids, NO_GEN, PoolingParams(PoolingTask.EMBED, pooling="last", normalize=True))


def test_shared_instruction_from_the_cache_gives_the_cold_vectors(qwen3: Any) -> None:
    texts = _texts(6)
    cold = run(tiny_engine(qwen3, prefix_caching=False, max_num_batched_tokens=512), [_embed(i, t) for i, t in
                                                                                       enumerate(texts)])
    engine = tiny_engine(qwen3, max_num_batched_tokens=512)
    first = run(engine, [_embed(0, texts[0])])  # computes and publishes the instruction
    assert engine.kv.stats.reused_tokens == 0
    warm = run(engine, [_embed(i, t) for i, t in enumerate(texts) if i])
    # every later text found the instruction's 16 whole blocks of 4 in the cache
    assert engine.kv.stats.reused_tokens >= 5 * (len(INSTRUCTION) // 4) * 4
    for rid, out in {**first, **warm}.items():
        got, want = torch.tensor(out.embedding), torch.tensor(cold[rid].embedding)
        assert (got - want).abs().max().item() < 1e-5, rid


def test_reward_over_a_shared_conversation_from_the_cache(reward_model: Any) -> None:
    conversation = list(b"<user>Write a haiku about the sea.<assistant>") * 3
    replies = [conversation + list(f"reply {i}: waves fold into foam".encode()) for i in range(8)]
    reqs = [(f"r{i}", ids, NO_GEN, PoolingParams(PoolingTask.CLASSIFY)) for i, ids in enumerate(replies)]
    cold = run(tiny_engine(reward_model, prefix_caching=False, max_num_batched_tokens=1024), reqs)
    engine = tiny_engine(reward_model, max_num_batched_tokens=1024)
    warm = run(engine, reqs)
    assert engine.kv.stats.reused_tokens > 0  # the peers rode on or hit the conversation's blocks
    for rid, out in warm.items():
        with torch.no_grad():
            want = reward_model(torch.tensor([replies[int(rid[1:])]])).logits[0, 0].item()
        assert out.scores[0] == pytest.approx(want, abs=1e-4)
        assert out.scores[0] == pytest.approx(cold[rid].scores[0], abs=1e-5)


@pytest.mark.parametrize("task", ["embed", "classify", "labels"])
def test_a_prompt_longer_than_a_step_runs_in_chunks(qwen3: Any, reward_model: Any, task: str) -> None:
    long = (INSTRUCTION * 4)[:250]  # 250 tokens, a step takes 64: three chunks of 16 blocks, then the rest
    model = reward_model if task == "classify" else qwen3
    pooling = {"embed": PoolingParams(PoolingTask.EMBED, pooling="last", normalize=True),
               "classify": PoolingParams(PoolingTask.CLASSIFY),
               "labels": PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3), label_softmax=True)}[task]
    whole = run(tiny_engine(model, prefix_caching=False, max_num_batched_tokens=64), [("x", long, NO_GEN, pooling)])
    engine = tiny_engine(model, max_num_batched_tokens=64)
    steps = 0
    engine.add_request("x", long, NO_GEN, pooling)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        steps += 1
    engine.check_integrity()
    assert steps == 4  # 64 + 64 + 64 tokens published, then the last 58 read them
    assert engine.kv.stats.reused_tokens == 64 + 128 + 192
    (out,) = outs
    field = "embedding" if task == "embed" else "scores"
    got, want = torch.tensor(getattr(out, field)), torch.tensor(getattr(whole["x"], field))
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize(("method", "skip"), [("mean", 0), ("mean", 70), ("max", 0), ("max", 130)])
def test_mean_and_max_pooling_run_in_chunks_with_a_running_pool(qwen3: Any, method: str, skip: int) -> None:
    """A causal model's mean (or max) pool of a prompt longer than a step: each chunk adds
    its rows to a running pool (the prompt's first `skip` tokens left out, across chunk
    boundaries), the last chunk finishes it; equal to the whole prompt pooled at once."""
    long = (INSTRUCTION * 4)[:250]
    pooling = PoolingParams(PoolingTask.EMBED, pooling=method, normalize=True, skip_tokens=skip)
    whole = run(tiny_engine(qwen3, prefix_caching=False, max_num_batched_tokens=512), [("x", long, NO_GEN, pooling)])
    engine = tiny_engine(qwen3, max_num_batched_tokens=64)
    engine.add_request("x", long, NO_GEN, pooling)
    outs, steps = [], 0
    while engine.has_unfinished():
        outs += engine.step()
        steps += 1
    engine.check_integrity()
    assert steps == 4
    (out,) = outs
    got, want = torch.tensor(out.embedding), torch.tensor(whole["x"].embedding)
    assert (got - want).abs().max().item() < 1e-5
    with torch.no_grad():  # and the pool is transformers' hidden states', from `skip` on
        hidden = qwen3.model(torch.tensor([long])).last_hidden_state[0, skip:]
    ref = hidden.mean(0) if method == "mean" else hidden.amax(0)
    assert (got - torch.nn.functional.normalize(ref, dim=0)).abs().max().item() < 1e-4
