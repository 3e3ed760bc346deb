"""The registry admits architectures by the checkpoint's own name, refuses in one line what it
cannot compute (an unknown architecture, a config field it would ignore, weights left
unread or missing), and a new architecture is one file plus its registry entry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from prelude import LLM, SamplingParams
from prelude.model import registry
from prelude.model.base import UnsupportedCheckpoint
from prelude.model.loading.files import load_model_files

from tests.engine.tiny import tiny_engine

transformers = pytest.importorskip("transformers")

TINY: dict[str, Any] = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _llama_dict(**overrides: Any) -> dict[str, Any]:
    return {**transformers.LlamaConfig(**TINY).to_dict(), "architectures": ["LlamaForCausalLM"], **overrides}


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Qwen3ForSequenceClassification", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                                  "Gemma3ForConditionalGeneration", "BertModel", "BertForSequenceClassification"])
def test_each_served_architecture_has_its_entry(name: str) -> None:
    assert registry.lookup(name).name == name


@pytest.mark.parametrize("name", ["FalconForCausalLM", "RobertaModel", "Phi3ForCausalLM"])
def test_an_unknown_architecture_is_refused_in_one_line_naming_it(name: str) -> None:
    with pytest.raises(UnsupportedCheckpoint) as refused:
        registry.config_for({**_llama_dict(), "architectures": [name]})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"architecture {name} is not supported; supported: ")
    assert "LlamaForCausalLM" in message and "Qwen3ForCausalLM" in message


@pytest.mark.parametrize(("overrides", "field"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "yarn"),
])
def test_a_config_field_the_model_would_ignore_is_refused_by_name(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedCheckpoint, match=field) as refused:
        registry.config_for(_llama_dict(**overrides))
    assert "LlamaForCausalLM" in str(refused.value) and "\n" not in str(refused.value)


def test_qwen2_sliding_layers_are_refused() -> None:
    raw = {**transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1).to_dict(),
           "architectures": ["Qwen2ForCausalLM"]}
    with pytest.raises(UnsupportedCheckpoint, match="sliding|layer_types"):
        registry.config_for(raw)


def _save(model: Any, folder: Path, extra: dict[str, torch.Tensor] | None = None,
          drop: str | None = None) -> Path:
    model.save_pretrained(folder)
    if extra or drop:
        weights = {k: v.clone() for k, v in model.state_dict().items() if k != drop}
        save_file({**weights, **(extra or {})}, str(folder / "model.safetensors"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    return folder


def _runner_of(folder: Path) -> None:
    """Build the model of `folder` as a start does (its config through the registry)."""
    from prelude.config import ExecutorConfig
    from prelude.executor.runner import ModelRunner
    from prelude.model.registry import config_for

    raw = json.loads((folder / "config.json").read_text())
    from safetensors.torch import load_file

    ModelRunner.create(config_for(raw, folder), load_file(str(folder / "model.safetensors")),
                       ExecutorConfig(device="cpu", dtype="float32"), 4)


def test_weights_left_unread_refuse_the_checkpoint_by_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    folder = _save(hf, tmp_path, extra={"model.layers.0.mlp.experts.0.w1.weight": torch.zeros(4, 64)})
    with pytest.raises(UnsupportedCheckpoint, match=r"model\.layers\.0\.mlp\.experts\.0\.w1\.weight.*not read"):
        _runner_of(folder)


def test_a_missing_weight_refuses_the_checkpoint_by_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=16))
    folder = _save(hf, tmp_path, drop="model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(UnsupportedCheckpoint, match=r"no tensor model\.layers\.1\.self_attn\.k_norm\.weight"):
        _runner_of(folder)


def test_the_loader_reads_the_config_through_the_registry(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=16))
    folder = _save(hf, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["hidden_act"] = "relu"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedCheckpoint, match="Qwen3ForCausalLM: config field hidden_act='relu'"):
        load_model_files(str(folder))


def test_a_toy_architecture_is_one_file_and_matches_transformers() -> None:
    """A Llama with a GELU-tanh MLP, registered by tests/model/toy_gelu_llama.py alone, runs
    through the shared layers and gives transformers' greedy tokens."""
    from tests.model import toy_gelu_llama

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, hidden_act="gelu_pytorch_tanh")).float().eval()
    hf.config.architectures = [toy_gelu_llama.NAME]
    engine = tiny_engine(hf, attention_backend="cpu")
    assert type(engine.runner.model).__name__ == toy_gelu_llama.NAME
    assert engine.runner.model.layer_loop is None  # the C loop runs the SiLU layer only
    prompt = list(range(40, 57))
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    out = LLM(engine=engine).generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected[0, len(prompt):].tolist()
    # and the registry still refuses the same config under the Llama name: SiLU is Llama's
    hf.config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(UnsupportedCheckpoint, match="hidden_act"):
        registry.config_for(hf.config.to_dict())
