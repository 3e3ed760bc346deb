"""A Qwen3_5ForConditionalGeneration checkpoint (a vision tower beside the text model)
served over HTTP: it starts, text prompts are answered as the text model answers them, and image or video content gets a 400 with an
OpenAI-style error body, never a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from prelude import LLM
from prelude.engine.async_engine import AsyncEngine
from tests.entrypoints.conftest import running_server

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from prelude.model.loading.files import load_model_files

    directory = tmp_path_factory.mktemp("qwen3_5_vl")
    torch.manual_seed(0)
    text = dict(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).float().eval()
    hf.save_pretrained(directory)
    source = load_model_files(None).model_dir  # the default model's tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    return directory, hf


@pytest.fixture(scope="module")
def server(vision_model: tuple[Path, Any]) -> Iterator[str]:
    llm = LLM(model=str(vision_model[0]), dtype="float32", device="cpu", kv_cache_memory_gib=0.01, max_num_seqs=4)
    with running_server(AsyncEngine(llm.engine)) as base:
        yield base


def _model(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_image", "image_url": "https://example.com/cat.png"},
    {"type": "video_url", "video_url": {"url": "https://example.com/cat.mp4"}},
], ids=["image_url", "input_image", "video_url"])
def test_image_and_video_content_gets_a_400(server: str, part: dict[str, Any]) -> None:
    body = {"model": _model(server), "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert part["type"] in error["message"] and "text model" in error["message"]
    assert error["param"] == "messages.0.content" and "Traceback" not in r.text
    # the server serves on
    ok = httpx.post(server + "/v1/completions", json={"model": _model(server), "prompt": [5, 6, 7], "max_tokens": 3,
                                                      "temperature": 0}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_the_text_model_answers_as_transformers(server: str, vision_model: tuple[Path, Any]) -> None:
    prompt = [11, 12, 13, 14, 15]
    r = httpx.post(server + "/v1/completions", json={"model": _model(server), "prompt": prompt, "max_tokens": 4,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    hf = vision_model[1]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                           pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(vision_model[0] / "tokenizer.json"))
    assert r.json()["choices"][0]["text"] == tokenizer.decode(want[0, len(prompt):].tolist())
