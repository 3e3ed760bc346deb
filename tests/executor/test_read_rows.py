"""The last layer computed for the read positions only (executor/read_rows.py): a step's
outputs equal those of the forward that computes every position, for every kind of row.

Two runners on the same random tiny weights, one pruning and one not, run the same steps
(OneShot rows with and without a cached prefix, multi-item label rows, classify and
embedding heads, prompt logprobs, chunked prefill beside decodes, fused OneShot rows);
their sampled tokens, logprobs and head outputs must agree, and the pruned one must have
computed only the rows read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from prelude.config import ExecutorConfig
from prelude.executor.read_rows import row_read, step_reads
from prelude.executor.runner import ModelRunner
from prelude.forward_batch import (BatchOutput, BatchRow, DecodeBatch, ForwardBatch, HeadSpec, MixedBatch,
                                   OneShotBatch, OneShotRow, SampleSpec)
from prelude.kv.kv_manager import KVCacheManager
from prelude.params import PoolingParams, PoolingTask, SamplingParams
from prelude.model.registry import config_for

transformers = pytest.importorskip("transformers")

BLOCK = 4
VOCAB = 300


def _hf(kv_heads: int) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


def _runner(hf: Any, dtype: str, backend: str, prune: bool) -> ModelRunner:
    config = config_for(hf.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    weights["score.weight"] = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))  # a classify head too
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8  # peaked logits: each position's differ clearly
    executor = ExecutorConfig(device="cpu", dtype=dtype, attention_backend=backend, prune_last_layer=prune)
    runner = ModelRunner.create(config, weights, executor, BLOCK)
    runner.allocate_kv_cache(96)
    return runner


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sample(prompt: list[int], out: tuple[int, ...] = ()) -> SampleSpec:
    return SampleSpec(SamplingParams(temperature=0.0, logprobs=5), prompt, list(out))


def _pool(task: PoolingTask, **kw: Any) -> HeadSpec:
    return HeadSpec(pooling=PoolingParams(task=task, **kw))


@dataclass
class Pair:
    """The pruning runner and the reference, stepped together; `rows_computed` records what
    the pruning runner's forwards returned against the tokens they ran."""

    pruned: ModelRunner
    full: ModelRunner
    tol: float
    exact_tokens: bool

    def __post_init__(self) -> None:
        self.rows_computed: list[tuple[int, int]] = []
        forward = self.pruned.forward

        def spy(inputs: Any, lora: Any = None, reads: Any = None) -> torch.Tensor:
            hidden = forward(inputs, lora, reads)
            self.rows_computed.append((hidden.shape[0], inputs.input_ids.shape[0]))
            return hidden

        self.pruned.forward = spy  # type: ignore[method-assign]

    def step(self, batch: ForwardBatch) -> BatchOutput:
        a, b = self.pruned.launch(batch).wait(), self.full.launch(batch).wait()
        _same(a, b, self.tol, self.exact_tokens)
        return b


def _close(x: Any, y: Any, tol: float) -> None:
    torch.testing.assert_close(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                               atol=tol, rtol=tol)


def _same(a: BatchOutput, b: BatchOutput, tol: float, exact_tokens: bool) -> None:
    assert a.sampled.keys() == b.sampled.keys() and a.heads.keys() == b.heads.keys()
    for rid, ta in a.sampled.items():
        tb = b.sampled[rid]
        assert ta.logprob is not None and tb.logprob is not None
        _close(sorted(v for _, v in ta.logprob.top), sorted(v for _, v in tb.logprob.top), tol)
        if exact_tokens:
            assert ta.token_id == tb.token_id and [i for i, _ in ta.logprob.top] == [i for i, _ in tb.logprob.top]
    for rid, ha in a.heads.items():
        hb = b.heads[rid]
        for field in ("scores", "embedding"):
            va, vb = getattr(ha, field), getattr(hb, field)
            assert (va is None) == (vb is None)
            if va is not None:
                _close(va, vb, tol)
        assert (ha.prompt_logprobs is None) == (hb.prompt_logprobs is None)
        if ha.prompt_logprobs is not None:
            assert hb.prompt_logprobs is not None
            _close([p.logprob for p in ha.prompt_logprobs[1:]], [p.logprob for p in hb.prompt_logprobs[1:]], tol)


CONFIGS = [("float32", 2e-4, True), ("bfloat16", 6e-2, False)]


@pytest.mark.parametrize("dtype,tol,exact", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_pruned_steps_give_the_unpruned_outputs(dtype: str, tol: float, exact: bool, backend: str,
                                                kv_heads: int) -> None:
    hf = _hf(kv_heads)
    pair = Pair(_runner(hf, dtype, backend, True), _runner(hf, dtype, backend, False), tol, exact)
    assert pair.pruned.prune_last_layer and not pair.full.prune_last_layer
    kv = KVCacheManager(96, BLOCK)

    # OneShot: a generating row publishing 5 blocks, heads reading one row, rows reading all
    gen = _tokens(23, 1)
    assert kv.allocate("pub", 20)
    published = tuple(kv.block_table("pub"))
    items = _tokens(6 + 3 + 4 + 2, 2)
    first = OneShotBatch((
        OneShotRow("gen", gen, _sample(gen), None, publish_blocks=published),
        OneShotRow("cls", _tokens(9, 3), None, _pool(PoolingTask.CLASSIFY)),
        OneShotRow("emb_last", _tokens(11, 4), None, _pool(PoolingTask.EMBED, pooling="last")),
        OneShotRow("emb_mean", _tokens(7, 5), None, _pool(PoolingTask.EMBED, pooling="mean")),
        OneShotRow("plp", _tokens(10, 6), _sample(_tokens(10, 6)), HeadSpec(prompt_logprobs=3)),
        OneShotRow("items", items, None, _pool(PoolingTask.LABELS, label_token_ids=(5, 9, 11), item_lens=(3, 4, 2)),
                   item_lens=(3, 4, 2)),
        OneShotRow("seq", items, None, _pool(PoolingTask.SEQUENCE_LOGPROBS, item_lens=(3, 4, 2)),
                   item_lens=(3, 4, 2)),
    ))
    pair.step(first)
    # read: gen 1, cls 1, emb_last 1, emb_mean all 7, plp all 10, items one per item 3, seq all 15
    assert pair.rows_computed[-1] == (1 + 1 + 1 + 7 + 10 + 3 + 15, 23 + 9 + 11 + 7 + 10 + 15 + 15)

    # OneShot over the cached prefix: a generating row and a multi-item row
    hit = gen[:20] + _tokens(7, 7)
    shared = gen[:20] + _tokens(3, 8)
    pair.step(OneShotBatch((
        OneShotRow("hit", hit, _sample(hit), None, num_cached=20, prefix_blocks=published),
        OneShotRow("hit_items", shared + _tokens(5, 9), None,
                   _pool(PoolingTask.LABELS, label_token_ids=(1, 2), item_lens=(2, 3)),
                   num_cached=16, prefix_blocks=published[:4], item_lens=(2, 3)),
    )))
    assert pair.rows_computed[-1] == (1 + 2, 7 + 12)

    # Chunked prefill beside decodes (paged KV), one step with a fused OneShot row
    short = _tokens(5, 10)
    assert kv.allocate("s", 5)
    out = pair.step(MixedBatch((BatchRow("s", short, 0, kv.block_table("s"), _sample(short)),), ()))
    seq = {"s": short + [out.sampled["s"].token_id]}
    long_prompt = _tokens(21, 11)
    done = 0
    for chunk in (9, 12):
        finishes = done + chunk == len(long_prompt)
        assert kv.allocate("l", done + chunk) and kv.allocate("s", len(seq["s"]))
        s = seq["s"]
        batch = MixedBatch(
            (BatchRow("l", long_prompt[done : done + chunk], done, kv.block_table("l"),
                      _sample(long_prompt) if finishes else None),),
            (BatchRow("s", [s[-1]], len(s) - 1, kv.block_table("s"), _sample(short, tuple(s[5:]))),),
            oneshot_rows=(OneShotRow("os", _tokens(6, 12), _sample(_tokens(6, 12)), None),) if finishes else (),
        )
        out = pair.step(batch)
        # the unfinished chunk reads nothing, the finishing one its last token, decodes theirs
        assert pair.rows_computed[-1] == ((1 + 1 + 1, chunk + 1 + 6) if finishes else (1, chunk + 1))
        done += chunk
        seq["s"] = s + [out.sampled["s"].token_id]
    seq["l"] = long_prompt + [out.sampled["l"].token_id]
    # Decodes read the last layer's K/V of every prompt token, read or not
    for _ in range(3):
        rows = []
        for rid, s in seq.items():
            assert kv.allocate(rid, len(s))
            prompt = short if rid == "s" else long_prompt
            rows.append(BatchRow(rid, [s[-1]], len(s) - 1, kv.block_table(rid), _sample(prompt, tuple(s[len(prompt):]))))
        out = pair.step(DecodeBatch(tuple(rows)))
        for rid in seq:
            seq[rid].append(out.sampled[rid].token_id)
    assert pair.rows_computed[-1] == (2, 2)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_the_forward_returns_exactly_the_read_rows(dtype: str, tol: float) -> None:
    # the trunk itself: the read rows' hidden states equal the full forward's rows
    runner = _runner(_hf(2), dtype, "cpu", True)
    rows = [OneShotRow("a", _tokens(19, 1), None, None), OneShotRow("b", _tokens(8, 2), None, None),
            OneShotRow("c", _tokens(13, 3), None, None)]
    inputs = runner.inputs.oneshot(rows)
    reads = step_reads(runner.device, inputs.starts, [19, 8, 13], [(18,), (), (2, 7, 12)],
                       [p.query_start for p in inputs.meta.prefills])
    assert reads is not None and reads.starts == [0, 1, 1]
    assert reads.positions.tail_queries.tolist() == [1, 0, 11]
    full = runner.forward(inputs)
    part = runner.forward(inputs, None, reads)
    torch.testing.assert_close(part.float(), full.index_select(0, torch.tensor([18, 19 + 8 + 2, 19 + 8 + 7, 39])).float(),
                               atol=tol, rtol=tol)


def test_pruned_lora_steps_give_the_unpruned_outputs(tmp_path: Any) -> None:
    # adapters per row: the last layer's o_proj/MLP deltas follow each read row's adapter
    pytest.importorskip("peft")
    from prelude.config import LoraConfig
    from prelude.params import LoraRequest
    from tests.engine.test_lora_engine import save_adapter
    from tests.engine.tiny import hf_tiny_llama

    loras = [LoraRequest(f"a{i}", str(tmp_path / f"a{i}"), i + 1) for i in range(2)]
    for i, lora in enumerate(loras):
        save_adapter(Path(lora.path), seed=30 + i)
    hf = hf_tiny_llama()
    config = config_for(hf.config.to_dict())

    def runner(prune: bool) -> ModelRunner:
        weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        weights["lm_head.weight"] = weights["lm_head.weight"] * 8
        r = ModelRunner.create(config, weights, ExecutorConfig(device="cpu", dtype="float32", attention_backend="cpu",
                                                               prune_last_layer=prune), BLOCK,
                               lora=LoraConfig(max_loras=2, max_lora_rank=8))
        r.allocate_kv_cache(32)
        return r

    pair = Pair(runner(True), runner(False), 2e-4, True)
    rows = [_tokens(9, 1), _tokens(12, 2), _tokens(7, 3), _tokens(10, 4), _tokens(8, 5)]
    rows = [[t % 256 for t in r] for r in rows]
    pair.step(OneShotBatch((
        OneShotRow("a0", rows[0], _sample(rows[0]), None, lora=loras[0]),
        OneShotRow("base", rows[1], _sample(rows[1]), None),
        OneShotRow("a1_emb", rows[2], None, _pool(PoolingTask.EMBED, pooling="last"), lora=loras[1]),
        OneShotRow("a1_plp", rows[3], _sample(rows[3]), HeadSpec(prompt_logprobs=2), lora=loras[1]),
        OneShotRow("a0_mean", rows[4], None, _pool(PoolingTask.EMBED, pooling="mean"), lora=loras[0]),
    )))
    assert pair.rows_computed[-1] == (1 + 1 + 1 + 10 + 8, 9 + 12 + 7 + 10 + 8)
    # only base rows read: the adapters' rows still shape the K/V, the last layer runs plain
    pair.step(OneShotBatch((OneShotRow("a0", rows[0], None, None, lora=loras[0]),
                            OneShotRow("base", rows[1], _sample(rows[1]), None))))
    assert pair.rows_computed[-1] == (1, 9 + 12)


def test_rows_read_by_each_kind_of_output() -> None:
    sample = _sample([1, 2, 3])
    assert row_read(5, sample, None, "last") == (4,)
    assert row_read(5, None, None, "last") == ()
    assert row_read(5, None, HeadSpec(prompt_logprobs=0), "last") is None
    assert row_read(1, sample, HeadSpec(prompt_logprobs=0), "last") == (0,)  # nothing before the first token
    assert row_read(5, None, _pool(PoolingTask.CLASSIFY), "mean") == (4,)
    assert row_read(5, None, _pool(PoolingTask.EMBED), "last") == (4,)
    assert row_read(5, None, _pool(PoolingTask.EMBED), "mean") is None
    assert row_read(5, None, _pool(PoolingTask.EMBED, pooling="cls"), "last") is None
    labels = _pool(PoolingTask.LABELS, label_token_ids=(1,), item_lens=(2, 1))
    assert row_read(6, sample, labels, "last") == (4, 5)
    assert row_read(6, None, _pool(PoolingTask.SEQUENCE_LOGPROBS, item_lens=(2, 1)), "last") is None
    # every position read: nothing to prune
    assert step_reads(torch.device("cpu"), [0, 3], [3, 1], [None, (0,)], [0]) is None


def test_off_computes_every_position_and_logs_the_choice(caplog: pytest.LogCaptureFixture) -> None:
    hf = _hf(2)
    with caplog.at_level("INFO", logger="prelude.executor"):
        on = _runner(hf, "float32", "cpu", True)
    assert any("last layer: computed only for the positions a head reads" in r.message for r in caplog.records)
    off = _runner(hf, "float32", "cpu", False)
    rows = [OneShotRow("a", _tokens(9, 1), None, _pool(PoolingTask.CLASSIFY))]
    assert on.step_reads_for(on.inputs.oneshot(rows), [("a", rows[0].token_ids, None, rows[0].head)]) is not None
    assert off.step_reads_for(off.inputs.oneshot(rows), [("a", rows[0].token_ids, None, rows[0].head)]) is None
