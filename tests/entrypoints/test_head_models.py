"""Models with heads, served over HTTP from HF directories: a BERT cross-encoder for
/rerank and /score, a one-output Llama head for /reward and /classify."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from prelude.config import EngineConfig, ExecutorConfig
from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.entrypoints.openai.api_server import build_app

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [c for c in "abcdefghijklmnopqrstuvwxyz"] + [
    "paris", "france", "capital", "banana", "yellow", "is", "the", "of", "what", "fruit"]


def _wordpiece(path: Path) -> Tokenizer:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"cls_token": "[CLS]", "sep_token": "[SEP]"}))
    return tok


def _serve(model_dir: Path) -> tuple[Any, AsyncEngine]:
    front = AsyncEngine(LLMEngine.from_config(EngineConfig(model=str(model_dir), executor=ExecutorConfig(device="cpu", dtype="float32"))))
    return build_app(front), front


async def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body)


def test_cross_encoder_rerank_and_score(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=1)
    hf = transformers.BertForSequenceClassification(cfg).eval()
    hf.save_pretrained(tmp_path)
    tok = _wordpiece(tmp_path)
    app, front = _serve(tmp_path)
    query, docs = "what is the capital of france", ["paris is the capital", "banana is yellow", "fruit"]
    r = asyncio.run(_post(app, "/v1/rerank", {"query": query, "documents": docs}))
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    for i, d in enumerate(docs):
        enc = tok.encode(query, d)
        with torch.no_grad():
            logit = hf(torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])).logits[0, 0].item()
        assert got[i] == pytest.approx(1 / (1 + math.exp(-logit)), abs=1e-5)
    scores = asyncio.run(_post(app, "/score", {"text_1": query, "text_2": docs})).json()["data"]
    assert [s["score"] for s in scores] == pytest.approx([got[i] for i in range(3)], abs=1e-6)
    bad = asyncio.run(_post(app, "/v1/completions", {"prompt": "paris", "max_tokens": 3}))
    assert bad.status_code == 400  # an encoder does not generate
    front.shutdown()


def test_reward_head(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    hf = transformers.LlamaForSequenceClassification(cfg).eval()
    hf.save_pretrained(tmp_path)
    tok = _wordpiece(tmp_path)
    app, front = _serve(tmp_path)
    texts = ["paris is the capital of france", "banana"]
    r = asyncio.run(_post(app, "/reward", {"input": texts}))
    assert r.status_code == 200, r.text
    for item, text in zip(r.json()["data"], texts):
        with torch.no_grad():
            ref = hf(torch.tensor([tok.encode(text).ids])).logits[0, 0].item()
        assert item["score"] == pytest.approx(ref, abs=1e-4)
    c = asyncio.run(_post(app, "/classify", {"input": texts})).json()["data"]
    assert c[0]["num_classes"] == 1 and 0 < c[0]["probs"][0] < 1
    front.shutdown()
