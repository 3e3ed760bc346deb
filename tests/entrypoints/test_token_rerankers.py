"""Rerankers that score with a token, set up from the checkpoint's config or --hf-overrides
(vLLM's names: classifier_from_token, method, is_original_qwen3_reranker): Qwen3-Reranker's
P(yes) against "no" and bge-reranker-v2-gemma's "Yes" logit, each under its model card's
template, on /v1/rerank and /v1/score; equal to transformers computing the same template."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from prelude.config import EngineConfig, ExecutorConfig
from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.entrypoints.openai import score_templates
from prelude.entrypoints.openai.api_server import build_app
from prelude.model.base import UnsupportedCheckpoint

from tests.entrypoints.st_folders import WORDS, perturb_norms, qwen3_config, write_tokenizer

transformers = pytest.importorskip("transformers")

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "banana is yellow", "fruit"]


def _causal_lm(path: Path, family: str, config_extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
    torch.manual_seed(0)
    if family == "qwen3":
        hf = transformers.Qwen3ForCausalLM(qwen3_config()).float().eval()
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=2)).float().eval()
    perturb_norms(hf)
    hf.save_pretrained(path)
    if config_extra:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config_extra}))
    return hf, write_tokenizer(path)


def _serve(path: Path, hf_overrides: dict[str, Any] | None = None) -> tuple[Any, AsyncEngine]:
    engine = LLMEngine.from_config(EngineConfig(model=str(path), executor=ExecutorConfig(device="cpu", dtype="float32"),
                                                hf_overrides=json.dumps(hf_overrides) if hf_overrides else None))
    front = AsyncEngine(engine)
    return build_app(front), front


async def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body)


def _last_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double()


def test_qwen3_reranker_from_hf_overrides(tmp_path: Path) -> None:
    hf, tok = _causal_lm(tmp_path, "qwen3")
    app, front = _serve(tmp_path, {"is_original_qwen3_reranker": True})
    instruction = "judge the answer"
    try:
        rerank = asyncio.run(_post(app, "/v1/rerank", {"query": QUERY, "documents": DOCS}))
        score = asyncio.run(_post(app, "/v1/score", {"text_1": QUERY, "text_2": DOCS, "instruction": instruction}))
    finally:
        front.shutdown()
    assert rerank.status_code == 200, rerank.text
    got = {r["index"]: r["relevance_score"] for r in rerank.json()["results"]}
    no, yes = WORDS.index("no"), WORDS.index("yes")
    for i, doc in enumerate(DOCS):
        for task, value in ((None, got[i]), (instruction, score.json()["data"][i]["score"])):
            text = (f"{score_templates.QWEN3_PREFIX}<Instruct>: {task or score_templates.QWEN3_INSTRUCTION}\n"
                    f"<Query>: {QUERY}\n<Document>: {doc}{score_templates.QWEN3_SUFFIX}")
            logits = _last_logits(hf, tok.encode(text, add_special_tokens=False).ids)
            want = torch.softmax(logits[[no, yes]], 0)[1].item()  # P(yes) over {no, yes}
            assert value == pytest.approx(want, abs=1e-4)


def test_bge_gemma_style_yes_logit_from_config(tmp_path: Path) -> None:
    """bge-reranker-v2-gemma's setup (vLLM: classifier_from_token ["Yes"], method
    no_post_processing) in config.json, on a Llama backbone (the registry serves no Gemma
    yet): the score is the sigmoid of the "yes" logit after its A/B template."""
    hf, tok = _causal_lm(tmp_path, "llama", {"classifier_from_token": ["yes"], "method": "no_post_processing",
                                             "score_template": "bge_reranker_gemma"})
    app, front = _serve(tmp_path)
    try:
        r = asyncio.run(_post(app, "/v1/score", {"text_1": QUERY, "text_2": DOCS}))
    finally:
        front.shutdown()
    assert r.status_code == 200, r.text
    enc = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    for doc, item in zip(DOCS, r.json()["data"], strict=True):
        ids = enc(f"A: {QUERY}") + enc("\n") + enc(f"B: {doc}") + enc("\n") + enc(score_templates.BGE_GEMMA_PROMPT)
        want = torch.sigmoid(_last_logits(hf, ids)[WORDS.index("yes")]).item()
        assert item["score"] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"classifier_from_token": ["banana yellow"]}, "classifier_from_token 'banana yellow' is 2 tokens, not one"),
    ({"classifier_from_token": ["yes"], "method": "from_2_way_softmax"}, "from_2_way_softmax needs two"),
    ({"classifier_from_token": ["no", "yes"], "method": "mean"}, "method 'mean' is not implemented"),
    ({"score_template": "monot5"}, "score_template 'monot5' is not known"),
])
def test_token_reranker_setups_that_cannot_be_served_are_refused(tmp_path: Path, overrides: dict[str, Any],
                                                                 message: str) -> None:
    _causal_lm(tmp_path, "qwen3")
    with pytest.raises(UnsupportedCheckpoint, match=message):
        _serve(tmp_path, overrides)
