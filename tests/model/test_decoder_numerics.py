"""Engine trunk + paged attention vs HF transformers on random-weight tiny models (float32)."""

from __future__ import annotations

import pytest
import torch

import dataclasses

from prelude import SamplingParams
from prelude.config import ExecutorConfig
from prelude.forward_batch import BatchRow, DecodeBatch, HeadSpec, MixedBatch, SampleSpec
from prelude.executor.runner import ModelRunner
from prelude.kv.kv_manager import KVCacheManager
from prelude.model.registry import config_for

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def _hf_model(kind: str) -> "transformers.PreTrainedModel":
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**TINY, sliding_window=None, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**TINY, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    # Random init leaves norms at 1 and biases at 0: perturb them so they are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


def _ours(hf: "transformers.PreTrainedModel", block_size: int = 4, num_blocks: int = 64) -> tuple[ModelRunner, KVCacheManager]:
    config = config_for(hf.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    runner = ModelRunner.create(config, weights, ExecutorConfig(device="cpu", dtype="float32"), block_size)
    runner.allocate_kv_cache(num_blocks)
    return runner, KVCacheManager(num_blocks, block_size)


def _hf_logits(hf: "transformers.PreTrainedModel", ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _run(runner: ModelRunner, rows: list[BatchRow]) -> list[torch.Tensor]:
    """Logits of every computed token, split per row: the serving trunk over the batch the
    scheduler would build, each row sampling and asking for prompt logprobs (so the heads
    read every position)."""
    greedy = SamplingParams(temperature=0.0)
    rows = [dataclasses.replace(r, sample=SampleSpec(greedy, r.token_ids, []), head=HeadSpec(prompt_logprobs=0))
            for r in rows]
    decode = [r for r in rows if len(r.token_ids) == 1 and r.start_pos > 0]
    prefill = [r for r in rows if r not in decode]
    batch = MixedBatch(tuple(prefill), tuple(decode), ()) if prefill else DecodeBatch(tuple(decode))
    with torch.inference_mode():
        hidden, starts, order, _ = runner.trunk(batch)
        logits = runner.model.compute_logits(hidden)
    ends = [*starts[1:], logits.shape[0]]
    by_id = {rid: logits[s:e] for (rid, *_), s, e in zip(order, starts, ends)}
    assert all(by_id[r.request_id].shape[0] == len(r.token_ids) for r in rows)
    return [by_id[r.request_id] for r in rows]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_batched_prefill_then_decode_matches_hf(kind: str) -> None:
    hf = _hf_model(kind)
    runner, kv = _ours(hf)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (7, 1, 13, 4)]
    rows = []
    for i, p in enumerate(prompts):
        assert kv.allocate(str(i), len(p))
        rows.append(BatchRow(str(i), p, 0, kv.block_table(str(i)), None))
    for p, logits in zip(prompts, _run(runner, rows)):
        assert (logits - _hf_logits(hf, p)).abs().max().item() <= 1e-4
    seqs = [list(p) for p in prompts]
    for _step in range(6):  # step-by-step decode, all rows batched
        rows = []
        for i, s in enumerate(seqs):
            s.append(int(_hf_logits(hf, s)[-1].argmax()))
            assert kv.allocate(str(i), len(s))
            rows.append(BatchRow(str(i), [s[-1]], len(s) - 1, kv.block_table(str(i)), None))
        for s, logits in zip(seqs, _run(runner, rows)):
            assert (logits[-1] - _hf_logits(hf, s)[-1]).abs().max().item() <= 1e-4
    for i in range(len(prompts)):
        kv.free(str(i))
    kv.check_integrity()
    assert kv.num_free_blocks == 64


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_chunked_prefill_mixed_with_decode_matches_hf(kind: str) -> None:
    hf = _hf_model(kind)
    runner, kv = _ours(hf)
    gen = torch.Generator().manual_seed(2)
    long_prompt = torch.randint(0, 300, (23,), generator=gen).tolist()
    short = torch.randint(0, 300, (5,), generator=gen).tolist()
    assert kv.allocate("s", len(short))
    _run(runner, [BatchRow("s", short, 0, kv.block_table("s"), None)])
    done = 0
    for chunk in (9, 6, 8):  # the long prompt in chunks, each step beside one decode row
        short.append(7)
        assert kv.allocate("s", len(short)) and kv.allocate("l", done + chunk)
        rows = [
            BatchRow("l", long_prompt[done : done + chunk], done, kv.block_table("l"), None),
            BatchRow("s", [7], len(short) - 1, kv.block_table("s"), None),
        ]
        long_logits, short_logits = _run(runner, rows)
        done += chunk
        ref = _hf_logits(hf, long_prompt[:done])[done - chunk :]
        assert (long_logits - ref).abs().max().item() <= 1e-4
        assert (short_logits[-1] - _hf_logits(hf, short)[-1]).abs().max().item() <= 1e-4
