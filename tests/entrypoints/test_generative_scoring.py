"""Generative scoring over HTTP (tiny random Llama, byte tokenizer): SGLang's /v1/score
shape, vLLM's /generative_scoring, whole-label /classify; answers vs HF transformers."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from tests.engine.tiny import hf_tiny_llama

pytest.importorskip("transformers")

LABELS = [97, 98, 121, 110]  # a b y n


def _post(base: str, path: str, body: object) -> httpx.Response:
    return httpx.post(base + path, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60)


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    return hf_tiny_llama()


def _ref(hf_model, ids: list[int], apply_softmax: bool) -> list[float]:  # noqa: ANN001
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)[LABELS]
    return (torch.softmax(lp, 0) if apply_softmax else lp.exp()).tolist()


@pytest.mark.parametrize("apply_softmax", [False, True])
def test_sglang_score_shape_matches_hf(served, hf_model, apply_softmax: bool) -> None:  # noqa: ANN001
    base, engine = served
    query = "Is this relevant to the weather? "
    items = ["sunny skies", "a", "rain all week long", "stock prices"]
    body = {"query": query, "items": items, "label_token_ids": LABELS, "apply_softmax": apply_softmax}
    packed = _post(base, "/v1/score", body)
    alone = _post(base, "/v1/score", {**body, "multi_item": False})
    assert packed.status_code == 200 and alone.status_code == 200, packed.text
    out = packed.json()
    assert out["object"] == "scoring" and len(out["scores"]) == len(items)
    # Packed: the query is computed once.
    assert out["usage"]["prompt_tokens"] == len(query) + sum(len(i) for i in items)
    for i, item in enumerate(items):
        ref = _ref(hf_model, list((query + item).encode()), apply_softmax)
        assert out["scores"][i] == pytest.approx(ref, abs=1e-5)
        assert alone.json()["scores"][i] == pytest.approx(ref, abs=1e-5)
        if apply_softmax:
            assert math.fsum(out["scores"][i]) == pytest.approx(1.0, abs=1e-5)
    engine.check_integrity()


def test_token_ids_item_first_and_rows_split_by_context(served, hf_model) -> None:  # noqa: ANN001
    base, engine = served  # max_model_len 256
    query = list(range(30, 130))  # 100 tokens
    items = [list(range(140 + i, 170 + i)) for i in range(8)]  # 8 x 30: 340 tokens, more than one row
    r = _post(base, "/v1/score", {"query": query, "items": items, "label_token_ids": LABELS})
    assert r.status_code == 200, r.text
    for i, item in enumerate(items):
        assert r.json()["scores"][i] == pytest.approx(_ref(hf_model, query + item, False), abs=1e-5)
    first = _post(base, "/v1/score", {"query": query[:20], "items": items[:3], "label_token_ids": LABELS,
                                      "item_first": True}).json()
    for i, item in enumerate(items[:3]):
        assert first["scores"][i] == pytest.approx(_ref(hf_model, item + query[:20], False), abs=1e-5)
    engine.check_integrity()


def test_vllm_generative_scoring_shape(served, hf_model) -> None:  # noqa: ANN001
    base, _ = served
    body = {"query": "Query: cats. Document: ", "items": ["cats purr", "cars honk"], "label_token_ids": [121, 110]}
    r = _post(base, "/generative_scoring", body)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and all(d["object"] == "score" for d in data)
    for d, item in zip(data, body["items"]):
        with torch.no_grad():
            logits = hf_model(torch.tensor([list((body["query"] + item).encode())])).logits[0, -1].float()
        ref = torch.softmax(logits[[121, 110]], 0)[0].item()
        assert d["score"] == pytest.approx(ref, abs=1e-5)


def _sequence_logprob(hf_model, prompt: list[int], label: list[int]) -> float:  # noqa: ANN001
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([prompt + label])).logits[0].float(), -1)
    return sum(lp[len(prompt) - 1 + t, label[t]].item() for t in range(len(label)))


@pytest.mark.parametrize("normalize", ["sum", "mean"])
def test_whole_label_classification(served, hf_model, normalize: str) -> None:  # noqa: ANN001
    base, engine = served
    labels = ["ab", "ac", "abcd", "z"]  # shared first tokens, 1 to 4 tokens
    texts = ["judge this", "and this one"]
    r = _post(base, "/classify", {"input": texts, "labels": labels, "normalize": normalize})
    assert r.status_code == 200, r.text
    for text, d in zip(texts, r.json()["data"]):
        scores = torch.tensor([_sequence_logprob(hf_model, list(text.encode()), list(lab.encode())) for lab in labels])
        if normalize == "mean":
            scores = scores / torch.tensor([len(lab) for lab in labels])
        ref = torch.softmax(scores, 0)
        assert d["probs"] == pytest.approx(ref.tolist(), abs=1e-5)
        assert d["label"] == labels[int(ref.argmax())]
    engine.check_integrity()
