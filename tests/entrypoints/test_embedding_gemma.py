"""EmbeddingGemma-style checkpoints: a random-weight `Gemma3TextModel` with
use_bidirectional_attention and sentence-transformers' modules (mean pooling, two Dense
layers, Normalize), served on /v1/embeddings as an encoder and compared with
transformers (every token's hidden state) and sentence-transformers (the vectors), on
inputs longer than the sliding window; prompts, Matryoshka cuts, bf16, and the generation
routes refused."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from prelude.config import EngineConfig, ExecutorConfig
from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.entrypoints.openai.api_server import build_app
from prelude.model.attention.metadata import AttentionMetadata, PrefillSlice
from prelude.model.base import UnsupportedCheckpoint
from prelude.model.registry import config_for

from tests.entrypoints.st_folders import WORDS, write_st_folder

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")
if not hasattr(transformers.Gemma3TextConfig(), "use_bidirectional_attention"):
    pytest.skip("this transformers has no bidirectional Gemma 3", allow_module_level=True)

WINDOW = 8  # config.json's sliding_window: a sliding layer sees 4 tokens on either side
LONG = ("what is the capital of france paris is the capital of france the fruit of a banana is yellow "
        "what is the fruit of a banana the capital of france is paris")
TEXTS = ["paris", "what is the capital of france", "banana is yellow", LONG, " ".join([LONG] * 5)]
QUERY = "given a web search query retrieve passages query :"
DOCUMENT = "document :"


def gemma3_trunk(extra: dict[str, Any]) -> Any:
    """EmbeddingGemma's trunk, small: sliding layers around one global layer."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, max_position_embeddings=512,
        query_pre_attn_scalar=16, use_bidirectional_attention=True, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"], **extra)
    return transformers.Gemma3TextModel(cfg).float().eval()


def write_embedding_gemma(path: Path, **kwargs: Any) -> Any:
    """The published stack: mean pooling, Dense 64 -> 256 -> 64 (Identity, no bias), Normalize."""
    return write_st_folder(path, trunk=gemma3_trunk, pooling="mean", dense=((256, "Identity"), (64, "Identity")),
                           dense_bias=False, **kwargs)


def _engine(path: Path, dtype: str = "float32") -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(path), executor=ExecutorConfig(device="cpu", dtype=dtype)))


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
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any, LLMEngine]:
    path = tmp_path_factory.mktemp("embedding-gemma")
    write_embedding_gemma(path, prompts={"query": QUERY, "document": DOCUMENT},
                          config_extra={"matryoshka_dimensions": [16, 32, 64]})
    engine = _engine(path)
    front = AsyncEngine(engine)
    yield path, build_app(front), st.SentenceTransformer(str(path), device="cpu"), engine
    front.shutdown()


def test_the_long_input_spans_several_windows(folder: tuple[Path, Any, Any, LLMEngine]) -> None:
    path, _, model, engine = folder
    assert json.loads((path / "config.json").read_text())["sliding_window"] == WINDOW
    assert len(model.tokenize([LONG])["input_ids"][0]) > 3 * WINDOW
    # long enough for the attention's query chunks (model/attention/bidirectional.py)
    assert len(model.tokenize(TEXTS[-1:])["input_ids"][0]) > 2 * (64 + WINDOW)
    assert engine.is_encoder and not engine.can_generate


def test_every_token_equals_transformers_on_rows_of_several_lengths(
        folder: tuple[Path, Any, Any, LLMEngine]) -> None:
    """One forward of five rows (padded to the longest inside the attention) against each
    row alone through transformers: every position of every row, the long ones included."""
    path, _, model, engine = folder
    hf = transformers.Gemma3TextModel.from_pretrained(str(path), dtype=torch.float32).eval()
    rows = [ids.tolist() for ids in model.tokenize(TEXTS)["input_ids"]]
    rows = [r[: int(m.sum())] for r, m in zip(rows, model.tokenize(TEXTS)["attention_mask"])]
    slices, at = [], 0
    for r in rows:
        slices.append(PrefillSlice(at, len(r), len(r), torch.empty(0, dtype=torch.long), own_kv_in_cache=False))
        at += len(r)
    meta = AttentionMetadata(None, tuple(slices), None, 16)
    ids = torch.tensor([t for r in rows for t in r])
    positions = torch.tensor([p for r in rows for p in range(len(r))])
    hidden = engine.runner.model.forward(ids, positions, meta, [])
    for s, r in zip(slices, rows):
        with torch.no_grad():
            want = hf(torch.tensor([r])).last_hidden_state[0]
        got = hidden[s.query_start: s.query_start + s.query_len]
        assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_float32_vectors_equal_sentence_transformers(folder: tuple[Path, Any, Any, LLMEngine]) -> None:
    _, app, model, _ = folder
    got = _vectors(_embed(app))
    want = model.encode(TEXTS, convert_to_tensor=True)
    assert got.shape == want.shape == (len(TEXTS), 64)
    assert min(_cosines(got, want)) >= 0.9999
    assert got.norm(dim=-1).tolist() == pytest.approx([1.0] * len(TEXTS), abs=1e-5)


def test_the_window_decides_the_vectors(folder: tuple[Path, Any, Any, LLMEngine], tmp_path: Path) -> None:
    """The same weights with a window wider than every text: the texts whose tokens all lie
    within 4 of each other keep their vectors, the others' move. What the tests above
    compare includes the window."""
    path, app, model, _ = folder
    wide_dir = tmp_path / "wide"
    shutil.copytree(path, wide_dir)
    cfg = json.loads((path / "config.json").read_text())
    (wide_dir / "config.json").write_text(json.dumps({**cfg, "sliding_window": 1024}))
    front = AsyncEngine(_engine(wide_dir))
    try:
        wide = _vectors(_embed(build_app(front)))
    finally:
        front.shutdown()
    lengths = [int(m.sum()) for m in model.tokenize(TEXTS)["attention_mask"]]
    assert [n - 1 <= WINDOW // 2 for n in lengths] == [True, False, True, False, False]
    cos = _cosines(wide, _vectors(_embed(app)))
    assert min(cos[0], cos[2]) >= 0.9999 and max(cos[1], cos[3], cos[4]) < 0.9999


def test_prompt_name_and_the_default_prompt(folder: tuple[Path, Any, Any, LLMEngine]) -> None:
    _, app, model, _ = folder
    got = _vectors(_embed(app, prompt_name="query"))
    want = model.encode(TEXTS, prompt_name="query", convert_to_tensor=True)
    assert min(_cosines(got, want)) >= 0.9999
    assert max(_cosines(got, model.encode(TEXTS, convert_to_tensor=True))) < 0.9999  # the prompt counts
    doc = _vectors(_embed(app, prompt_name="document"))
    assert min(_cosines(doc, model.encode(TEXTS, prompt_name="document", convert_to_tensor=True))) >= 0.9999
    r = _embed(app, prompt_name="passage")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_name"


def test_matryoshka_dimensions(folder: tuple[Path, Any, Any, LLMEngine]) -> None:
    path, app, _, _ = folder
    cut = _vectors(_embed(app, dimensions=32))
    assert cut.shape == (len(TEXTS), 32)
    ref = st.SentenceTransformer(str(path), device="cpu", truncate_dim=32).encode(
        TEXTS, convert_to_tensor=True, normalize_embeddings=True)
    assert min(_cosines(cut, ref)) >= 0.9999
    r = _embed(app, dimensions=24)
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_generation_routes_answer_400(folder: tuple[Path, Any, Any, LLMEngine]) -> None:
    _, app, _, _ = folder
    for route, body in (("/v1/completions", {"prompt": "paris", "max_tokens": 4}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "paris"}]})):
        r = asyncio.run(_post(app, route, body))
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    r = asyncio.run(_post(app, "/v1/completions", {"prompt": "paris", "max_tokens": 4}))
    assert "does not generate text" in r.json()["error"]["message"]


def test_bf16_within_tolerance(folder: tuple[Path, Any, Any, LLMEngine]) -> None:
    path, _, model, _ = folder
    front = AsyncEngine(_engine(path, dtype="bfloat16"))
    try:
        got = _vectors(_embed(build_app(front)))
    finally:
        front.shutdown()
    assert min(_cosines(got, model.encode(TEXTS, convert_to_tensor=True))) >= 0.99


def test_bidirectional_with_a_head_is_refused_in_one_line() -> None:
    raw = {**gemma3_trunk({}).config.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    with pytest.raises(UnsupportedCheckpoint) as info:
        config_for(raw)
    assert "use_bidirectional_attention" in str(info.value) and "\n" not in str(info.value)


# google/embeddinggemma-300m's config.json (its shapes and the fields that decide the numbers)
PUBLISHED = {"architectures": ["Gemma3TextModel"], "model_type": "gemma3_text", "_sliding_window_pattern": 6,
             "attention_bias": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
             "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 768,
             "intermediate_size": 1152, "max_position_embeddings": 2048, "num_attention_heads": 3,
             "num_hidden_layers": 24, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 512,
             "use_bidirectional_attention": True, "vocab_size": 262144, "pad_token_id": 0, "eos_token_id": 1,
             "bos_token_id": 2}


def test_the_published_config_is_read_as_an_encoder() -> None:
    cfg = config_for(PUBLISHED)
    assert cfg.bidirectional and cfg.window == 512 and not cfg.tie_word_embeddings
    assert [i for i, kind in enumerate(cfg.layer_kinds) if kind == "full"] == [5, 11, 17, 23]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
