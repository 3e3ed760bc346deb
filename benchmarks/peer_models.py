"""Random-weight HF directories at the published shapes of the models the new-architecture
issues compare against peers, for `prelude bench serve --model DIR`:

    python -m benchmarks.peer_models [--out DIR] [--only gemma-3-1b,...]

- gemma-3-1b: Gemma-3-1B's text config (sliding and global layers);
- qwen3-30b-a3b-4l: Qwen3-30B-A3B with its layers cut to 4 (128 experts, top-8: the
  expert shapes are what a token's cost depends on);
- qwen3.5-0.8b: the smallest Qwen3.5 (18 Gated DeltaNet and 6 gated attention layers).

Every directory has the vocab cut to the default model's 49,152 and carries its tokenizer,
so one prompt set serves every peer. transformers builds and saves the weights (bf16,
the hub's tensor names and layout), so any peer that loads hub checkpoints loads these.
Prints each directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from prelude.cache_dirs import cache_root

VOCAB = 49152

SHAPES: dict[str, dict[str, Any]] = {
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "rope_scaling": None,
    },
    "qwen3-30b-a3b-4l": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 4,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
    "qwen3.5-0.8b": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 1024,
        "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": True,
    },
}


def build(name: str, root: Path) -> Path:
    """The directory of shape `name` under `root` (built on first use)."""
    import torch
    import transformers

    from prelude.model.loading.files import load_model_files

    out = root / name
    if (out / "config.json").exists():
        return out
    source = load_model_files(None).model_dir
    base = json.loads((source / "config.json").read_text())
    raw = {**SHAPES[name], "vocab_size": VOCAB, "bos_token_id": base.get("bos_token_id"),
           "eos_token_id": base.get("eos_token_id"), "pad_token_id": None, "torch_dtype": "bfloat16"}
    config = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / f).exists():
            shutil.copy(source / f, tmp / f)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peer_models")
    ap.add_argument("--out", default=str(cache_root() / "peer-models"))
    ap.add_argument("--only", default=",".join(SHAPES), help=f"comma list of: {', '.join(SHAPES)}")
    args = ap.parse_args(argv)
    for name in args.only.split(","):
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        print(build(name, Path(args.out)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
