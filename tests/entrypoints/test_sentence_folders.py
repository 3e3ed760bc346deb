"""sentence-transformers folders on a decoder backbone (a random-weight Qwen3 trunk),
served over /v1/embeddings and compared with sentence-transformers itself: last-token and
mean pooling, Dense layers, Normalize, prompts chosen by `prompt_name` or by default, the
prompt left out of the pool (include_prompt false), Matryoshka cuts, and the folders and
fields that are refused."""

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
from prelude.entrypoints.openai.api_server import build_app
from prelude.model.base import UnsupportedCheckpoint

from tests.entrypoints.st_folders import write_st_folder

pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

TEXTS = ["what is the capital of france", "paris", "banana is yellow", "the fruit of a banana is yellow"]
INSTRUCT = "instruct : given a web search query retrieve passages query :"


def _engine(path: Path, dtype: str = "float32", hf_overrides: dict[str, Any] | None = None) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(path), executor=ExecutorConfig(device="cpu", dtype=dtype),
                                              hf_overrides=json.dumps(hf_overrides) if hf_overrides else None))


async def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body)


def _embed(app: Any, **body: Any) -> httpx.Response:
    return asyncio.run(_post(app, "/v1/embeddings", {"input": TEXTS, **body}))


def _vectors(r: httpx.Response) -> torch.Tensor:
    assert r.status_code == 200, r.text
    return torch.tensor([d["embedding"] for d in r.json()["data"]])


def _cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).tolist()


@pytest.fixture(scope="module")
def last_token(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """Qwen3-Embedding's stack: last-token pooling, Normalize, a query prompt."""
    path = tmp_path_factory.mktemp("qwen3-embed")
    write_st_folder(path, prompts={"query": INSTRUCT, "document": ""})
    front = AsyncEngine(_engine(path))
    yield path, build_app(front), st.SentenceTransformer(str(path), device="cpu")
    front.shutdown()


def test_last_token_normalize_equals_sentence_transformers(last_token: tuple[Path, Any, Any]) -> None:
    _, app, model = last_token
    got = _vectors(_embed(app))
    want = model.encode(TEXTS, convert_to_tensor=True)
    assert got.shape == want.shape
    assert min(_cosines(got, want)) >= 0.9999
    assert got.norm(dim=-1).tolist() == pytest.approx([1.0] * len(TEXTS), abs=1e-5)


def test_prompt_name_picks_the_prompt(last_token: tuple[Path, Any, Any]) -> None:
    _, app, model = last_token
    got = _vectors(_embed(app, prompt_name="query"))
    want = model.encode(TEXTS, prompt_name="query", convert_to_tensor=True)
    assert min(_cosines(got, want)) >= 0.9999
    plain = model.encode(TEXTS, convert_to_tensor=True)
    assert max(_cosines(got, plain)) < 0.999  # the prompt changed the vectors
    r = _embed(app, prompt_name="passage")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_name"
    assert "query, document" in r.json()["error"]["message"]


def test_dimensions_refused_without_matryoshka(last_token: tuple[Path, Any, Any]) -> None:
    _, app, _ = last_token
    r = _embed(app, dimensions=16)
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert "Matryoshka" in r.json()["error"]["message"]


def test_bf16_within_tolerance(last_token: tuple[Path, Any, Any]) -> None:
    path, _, model = last_token
    engine = _engine(path, dtype="bfloat16")
    front = AsyncEngine(engine)
    try:
        got = _vectors(_embed(build_app(front)))
    finally:
        front.shutdown()
    want = model.encode(TEXTS, convert_to_tensor=True)
    assert min(_cosines(got, want)) >= 0.99


def test_matryoshka_cut_renormalizes(tmp_path: Path) -> None:
    write_st_folder(tmp_path, config_extra={"matryoshka_dimensions": [16, 32, 64]})
    front = AsyncEngine(_engine(tmp_path))
    try:
        app = build_app(front)
        full = _vectors(_embed(app))
        cut = _vectors(_embed(app, dimensions=32))
        assert cut.shape == (len(TEXTS), 32)
        want = torch.nn.functional.normalize(full[:, :32], dim=-1)
        assert (cut - want).abs().max().item() < 1e-5
        model = st.SentenceTransformer(str(tmp_path), device="cpu", truncate_dim=32)
        ref = model.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=True)
        assert min(_cosines(cut, ref)) >= 0.9999
        r = _embed(app, dimensions=24)
        assert r.status_code == 400 and "16, 32, 64" in r.json()["error"]["message"]
        r = _embed(app, dimensions=0)
        assert r.status_code == 400
    finally:
        front.shutdown()


def test_hf_override_declares_any_size(tmp_path: Path) -> None:
    write_st_folder(tmp_path)
    front = AsyncEngine(_engine(tmp_path, hf_overrides={"is_matryoshka": True}))
    try:
        app = build_app(front)
        cut = _vectors(_embed(app, dimensions=24))
        assert cut.shape == (len(TEXTS), 24)
        assert _embed(app, dimensions=65).status_code == 400
    finally:
        front.shutdown()


def test_mean_pooling_dense_and_excluded_prompt(tmp_path: Path) -> None:
    """EmbeddingGemma's stack on a Qwen3 trunk: mean pooling, two Dense layers (the first
    widening, the second back), Normalize; here the prompt is left out of the pool and is the
    default prompt."""
    write_st_folder(tmp_path, pooling="mean", include_prompt=False, dense=((96, "Identity"), (48, "Tanh")),
                    prompts={"query": INSTRUCT}, default_prompt="query")
    front = AsyncEngine(_engine(tmp_path))
    try:
        got = _vectors(_embed(build_app(front)))
    finally:
        front.shutdown()
    model = st.SentenceTransformer(str(tmp_path), device="cpu")
    want = model.encode(TEXTS, convert_to_tensor=True)  # the default prompt, as ours
    assert got.shape == want.shape == (len(TEXTS), 48)
    assert min(_cosines(got, want)) >= 0.9999


@pytest.mark.parametrize("pooling", ["cls", "max"])
def test_cls_and_max_pooling_without_normalize(tmp_path: Path, pooling: str) -> None:
    write_st_folder(tmp_path, pooling=pooling, normalize=False, dense=((32, "GELU"),))
    front = AsyncEngine(_engine(tmp_path))
    try:
        got = _vectors(_embed(build_app(front)))
    finally:
        front.shutdown()
    want = st.SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert (got - want).abs().max().item() < 1e-4  # no Normalize: the raw vectors, equal


def _rewrite(path: Path, name: str, edit: Any) -> None:
    data = json.loads((path / name).read_text())
    (path / name).write_text(json.dumps(edit(data)))


@pytest.mark.parametrize("case", ["weightedmean", "dense-size", "unknown-module", "activation"])
def test_folders_that_cannot_be_computed_are_refused_in_one_line(tmp_path: Path, case: str) -> None:
    write_st_folder(tmp_path, dense=((32, "Tanh"),))
    if case == "weightedmean":
        _rewrite(tmp_path, "1_Pooling/config.json", lambda c: {**c, "pooling_mode": "weightedmean"})
        want = "pooling mode 'weightedmean' is not implemented"
    elif case == "dense-size":
        _rewrite(tmp_path, "2_Dense/config.json", lambda c: {**c, "in_features": 48})
        want = "Dense module 2_Dense maps 48 -> 32 features"
    elif case == "unknown-module":
        _rewrite(tmp_path, "modules.json", lambda m: m + [{"idx": 9, "name": "9", "path": "9_LayerNorm",
                                                          "type": "sentence_transformers.models.LayerNorm"}])
        want = "module LayerNorm (9_LayerNorm) is not implemented"
    else:
        _rewrite(tmp_path, "2_Dense/config.json",
                 lambda c: {**c, "activation_function": "torch.nn.modules.activation.Softplus"})
        want = "activation Softplus is not implemented"
    with pytest.raises(UnsupportedCheckpoint) as info:
        _engine(tmp_path)
    message = str(info.value)
    assert want in message and "\n" not in message
