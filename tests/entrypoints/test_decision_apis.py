"""Decision-style APIs over HTTP (tiny random Llama): OneShot completions, lm-eval-style
loglikelihood payloads, prompt logprobs, embeddings, classify, score/rerank, bad inputs."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import pytest
import torch

from tests.engine.tiny import hf_tiny_llama

pytest.importorskip("transformers")


def _post(base: str, path: str, body: object) -> httpx.Response:
    return httpx.post(base + path, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=30)


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    return hf_tiny_llama()


def test_lm_eval_loglikelihood_payload(served, hf_model) -> None:  # noqa: ANN001
    base, engine = served
    contexts = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116]]
    body = {"model": "tiny-llama", "prompt": contexts, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    r = _post(base, "/v1/completions", body)
    assert r.status_code == 200, r.text
    for ctx, choice in zip(contexts, r.json()["choices"]):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["token_logprobs"]) == len(ctx) + 1  # prompt tokens + the generated one
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ctx])).logits[0].float(), -1)
        for j in range(1, len(ctx)):
            assert abs(lp["token_logprobs"][j] - ref[j - 1, ctx[j]].item()) <= 1e-4
            top = lp["top_logprobs"][j]
            assert bytes([ref[j - 1].argmax().item()]).decode("utf-8", "replace") in top
            assert lp["tokens"][j] in top  # the actual token is always listed, as OpenAI does
    engine.check_integrity()
    assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks


def test_prompt_logprobs_field(served) -> None:  # noqa: ANN001
    base, _ = served
    r = _post(base, "/v1/completions", {"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 2}).json()
    pl = r["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == 3
    entry = pl[1][str(ord("b"))]
    assert entry["decoded_token"] == "b" and entry["rank"] >= 1 and entry["logprob"] <= 0


def test_embeddings_float_and_base64(served) -> None:  # noqa: ANN001
    base, _ = served
    f = _post(base, "/v1/embeddings", {"input": ["one", "two"], "pooling": "mean"}).json()
    b = _post(base, "/v1/embeddings", {"input": ["one", "two"], "pooling": "mean", "encoding_format": "base64"}).json()
    assert [d["index"] for d in f["data"]] == [0, 1] and f["usage"]["prompt_tokens"] == 6
    for fd, bd in zip(f["data"], b["data"]):
        raw = base64.b64decode(bd["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert decoded == pytest.approx(fd["embedding"], abs=1e-6)
        assert sum(x * x for x in fd["embedding"]) == pytest.approx(1.0, abs=1e-4)  # normalized by default


def test_label_classification_and_rerank(served, hf_model) -> None:  # noqa: ANN001
    base, _ = served
    r = _post(base, "/classify", {"input": ["judge this", "and this"], "labels": ["a", "b", "c"]}).json()
    assert [d["index"] for d in r["data"]] == [0, 1]
    with torch.no_grad():
        logits = hf_model(torch.tensor([list(b"judge this")])).logits[0, -1]
    ref = torch.softmax(torch.log_softmax(logits, -1)[[97, 98, 99]], -1)
    assert r["data"][0]["probs"] == pytest.approx(ref.tolist(), abs=1e-4)
    assert r["data"][0]["label"] == "abc"[int(ref.argmax())]
    rr = _post(base, "/v1/rerank", {"query": "q", "documents": ["d1", {"text": "d2"}, "d3"], "top_n": 2,
                                    "template": "Q: {query} D: {document} relevant?"}).json()
    scores = [x["relevance_score"] for x in rr["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    every = _post(base, "/v1/rerank", {"query": "q", "documents": ["d1", "d2", "d3"], "top_n": 0}).json()
    assert len(every["results"]) == 3  # top_n 0: every document, as vLLM
    sc = _post(base, "/score", {"text_1": "q", "text_2": ["d1", "d2", "d3"],
                                "template": "Q: {query} D: {document} relevant?"}).json()
    by_index = {x["index"]: x["relevance_score"] for x in rr["results"]}
    for d in sc["data"]:
        if d["index"] in by_index:
            assert d["score"] == pytest.approx(by_index[d["index"]], abs=1e-6)


BAD = [
    ("/v1/embeddings", {"input": []}),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}),
    ("/v1/embeddings", {"input": "z" * 300}),
    ("/classify", {"input": []}),
    ("/classify", {"input": "x"}),  # no head and no labels
    ("/classify", {"input": "x", "labels": []}),
    ("/classify", {"input": "x", "labels": ["ab", ""]}),  # a label without tokens
    ("/classify", {"input": "x", "labels": ["ab"], "normalize": "max"}),
    ("/score", {"text_1": "a"}),
    ("/v1/score", {"query": "q", "items": ["a"]}),  # no label_token_ids
    ("/v1/score", {"query": "q", "items": [], "label_token_ids": [1]}),
    ("/v1/score", {"query": "q", "items": ["a", ""], "label_token_ids": [1]}),
    ("/v1/score", {"query": "", "items": ["a"], "label_token_ids": [1]}),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [100000]}),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": []}),
    ("/v1/score", {"query": "q" * 300, "items": ["a"], "label_token_ids": [1]}),  # over the context
    ("/generative_scoring", {"query": "q", "items": ["a"]}),
    ("/generative_scoring", {"query": "q", "items": ["a"], "label_token_ids": [-1]}),
    ("/v1/rerank", {"query": "q"}),
    ("/v1/rerank", {"query": "q", "documents": []}),
    ("/v1/rerank", {"query": "q", "documents": [{"title": "no text"}]}),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "template": "no placeholders"}),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
    ("/reward", {"input": "x"}),  # no one-label head
]


@pytest.mark.parametrize("path,body", BAD, ids=[f"{p}:{i}" for i, (p, _) in enumerate(BAD)])
def test_bad_decision_requests_get_400(served, path: str, body: dict) -> None:  # noqa: ANN001
    base, engine = served
    r = _post(base, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert _post(base, "/v1/embeddings", {"input": "fine"}).status_code == 200
    engine.check_integrity()
