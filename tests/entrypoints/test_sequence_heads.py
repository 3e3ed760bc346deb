"""Sequence-classification and reward heads (`*ForSequenceClassification`) on every decoder
architecture the registry serves, read at the last token, against transformers; and the
`activation` choice of /classify and /reward."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
import pytest
import torch

from prelude.engine.async_engine import AsyncEngine
from prelude.entrypoints.openai.api_server import build_app

from tests.engine.tiny import EOS, VOCAB, tiny_engine

transformers = pytest.importorskip("transformers")

TEXTS = ["is the sky blue?", "a reward model reads the last token", "x"]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=EOS, eos_token_id=EOS)
# Every decoder architecture of the registry, as its *ForSequenceClassification
HEADS = {
    "Llama": lambda n: transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**SHAPE, num_labels=n)),
    "Mistral": lambda n: transformers.MistralForSequenceClassification(
        transformers.MistralConfig(**SHAPE, num_labels=n, sliding_window=None)),
    "Qwen2": lambda n: transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**SHAPE, num_labels=n)),
    "Qwen3": lambda n: transformers.Qwen3ForSequenceClassification(
        transformers.Qwen3Config(**SHAPE, head_dim=16, num_labels=n)),
}


def _hf(family: str, num_labels: int) -> Any:
    torch.manual_seed(0)
    model = HEADS[family](num_labels).float().eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.config.architectures = [type(model).__name__]  # as save_pretrained writes it
    return model


def _logits(hf: Any, text: str) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([list(text.encode())])).logits[0].double()


async def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body)


def _serve(hf: Any) -> tuple[Any, AsyncEngine]:
    front = AsyncEngine(tiny_engine(hf, num_blocks=64))
    return build_app(front), front


@pytest.mark.parametrize("family", list(HEADS))
def test_classifier_head_equals_transformers(family: str) -> None:
    hf = _hf(family, 3)
    app, front = _serve(hf)
    try:
        raw = asyncio.run(_post(app, "/classify", {"input": TEXTS, "activation": "none"}))
        assert raw.status_code == 200, raw.text
        soft = asyncio.run(_post(app, "/classify", {"input": TEXTS})).json()["data"]  # default: softmax
        sig = asyncio.run(_post(app, "/classify", {"input": TEXTS, "activation": "sigmoid"})).json()["data"]
    finally:
        front.shutdown()
    for text, r, s, g in zip(TEXTS, raw.json()["data"], soft, sig, strict=True):
        want = _logits(hf, text)
        assert r["probs"] == pytest.approx(want.tolist(), abs=1e-4)
        assert s["probs"] == pytest.approx(torch.softmax(want, 0).tolist(), abs=1e-5)
        assert g["probs"] == pytest.approx(torch.sigmoid(want).tolist(), abs=1e-5)
        assert r["label"] == s["label"] == f"LABEL_{int(want.argmax())}"


@pytest.mark.parametrize("family", list(HEADS))
def test_reward_head_equals_transformers(family: str) -> None:
    hf = _hf(family, 1)
    app, front = _serve(hf)
    try:
        raw = asyncio.run(_post(app, "/reward", {"input": TEXTS}))
        sig = asyncio.run(_post(app, "/reward", {"input": TEXTS, "activation": "sigmoid"}))
        classify = asyncio.run(_post(app, "/classify", {"input": TEXTS}))  # one output: sigmoid by default
        soft = asyncio.run(_post(app, "/classify", {"input": TEXTS, "activation": "softmax"}))
        bad = asyncio.run(_post(app, "/reward", {"input": TEXTS, "activation": "softmax"}))
    finally:
        front.shutdown()
    assert raw.status_code == sig.status_code == classify.status_code == 200
    for text, r, s, c in zip(TEXTS, raw.json()["data"], sig.json()["data"], classify.json()["data"], strict=True):
        want = _logits(hf, text)[0].item()
        assert r["score"] == pytest.approx(want, abs=1e-4)
        assert s["score"] == pytest.approx(1 / (1 + math.exp(-want)), abs=1e-5)
        assert c["probs"] == pytest.approx([1 / (1 + math.exp(-want))], abs=1e-5)
    assert soft.status_code == 400 and soft.json()["error"]["param"] == "activation"
    assert bad.status_code == 400
