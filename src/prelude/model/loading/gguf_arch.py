"""What llama.cpp's converter did to each GGUF architecture's tensors and config, undone:
GGUF names back to HF names, each tensor back to the checkpoint's own values, and the
`{arch}.*` metadata back to a HF config the architecture files read.

The conventions undone, per `general.architecture` (llama.cpp's convert_hf_to_gguf.py and
its model loaders):
- llama: q/k rows of each head interleaved (its rotary is the GPT-J pairing); undone by
  gguf_convert.unpermute_rotary.
- gemma3: every RMSNorm weight stored with the 1 of Gemma's (1 + w) already added. One global
  layer every 6, the others slide `attention.sliding_window` with RoPE base 10 000; the
  attention scale is head_dim ** -0.5 (hidden / heads for the 62-layer 27B).
- qwen3moe: each layer's experts stacked 3-D (`ffn_gate_exps`, `ffn_up_exps` [E, I, H],
  `ffn_down_exps` [E, H, I]), router `ffn_gate_inp`; every layer a mixture; llama.cpp always
  renormalizes the top-k weights (norm_topk_prob).
- qwen35 (Qwen3.5) and qwen3next (Qwen3-Next): (1 + w) norms stored with the 1 added, except
  the DeltaNet's gated norm (`ssm_norm`); `ssm_a` = -exp(A_log); conv1d squeezed to
  [channels, kernel]; `ssm_dt.bias` is dt_bias. qwen35 (not qwen3next) stores the value heads
  of every DeltaNet tensor in "tiled" order (value head j of key group g at j * groups + g)
  where HF groups them by key head (g * per_group + j); qwen3next splits in_proj_qkvz into
  `attn_qkv` (q, k, v blocks) and `attn_gate` (z). The trailing `nextn_predict_layers`
  blocks are a multi-token-prediction head (a draft model), which no answer reads.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from prelude.model.base import UnsupportedCheckpoint
from prelude.model.loading.gguf_file import GgufFile

logger = logging.getLogger("prelude.model.loading.gguf_arch")

# GGUF layer tensor (without `blk.N.`) -> HF name under `model.layers.N.`
_LAYER = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Per architecture, what differs from or adds to _LAYER
_GEMMA3 = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
           "post_attention_norm.weight": "post_attention_layernorm.weight",
           "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_EXPERTS = {"ffn_gate_inp.weight": "mlp.gate.weight",
            "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
            "ffn_down_exps.weight": "mlp.experts.down_proj"}
_SHARED_EXPERT = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                  "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
_HYBRID = {"post_attention_norm.weight": "post_attention_layernorm.weight",
           "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
           "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
           "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
           "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",  # older qwen3next files: HF's grouped rows as they are
           "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
           "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_norm.weight": "linear_attn.norm.weight",
           "ssm_out.weight": "linear_attn.out_proj.weight"}
_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _LAYER, "qwen2": _LAYER, "qwen3": _LAYER,
    "gemma3": {**_LAYER, **_GEMMA3},
    "qwen3moe": {**_LAYER, **_EXPERTS},
    "qwen35": {**_LAYER, **_HYBRID},
    "qwen3next": {**_LAYER, **_HYBRID, **_EXPERTS, **_SHARED_EXPERT},
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
HYBRIDS = ("qwen35", "qwen3next")
# GGUF architectures whose HF checkpoints hold (1 + w) RMSNorm weights: llama.cpp stored w + 1
_ONE_PLUS_NORMS = ("gemma3",) + HYBRIDS


def architectures() -> tuple[str, ...]:
    """The GGUF architectures whose tensors this module names."""
    return tuple(_LAYER_NAMES)


def mtp_layers(reader: GgufFile, arch: str) -> int:
    """How many trailing blocks are a multi-token-prediction head (left out)."""
    return int(reader.field(f"{arch}.nextn_predict_layers", 0) or 0)


def trunk_layers(reader: GgufFile, arch: str) -> int:
    return int(reader.field(f"{arch}.block_count")) - mtp_layers(reader, arch)


def hf_name(arch: str, gguf_name: str, layers: int | None = None) -> str | None:
    """The HF name of a GGUF tensor; None for a block past `layers` (a multi-token-
    prediction head, left out). Refused in one line for a tensor no HF model holds."""
    names = _LAYER_NAMES.get(arch, _LAYER)
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m:
        layer, part = int(m.group(1)), m.group(2)
        if layers is not None and layer >= layers:
            return None
        if part not in names:
            raise UnsupportedCheckpoint(f"GGUF architecture {arch!r}: tensor {gguf_name} is not supported")
        return f"model.layers.{layer}.{names[part]}"
    if gguf_name not in _GLOBAL:
        raise UnsupportedCheckpoint(f"GGUF architecture {arch!r}: tensor {gguf_name} is not supported")
    return _GLOBAL[gguf_name]


# --- tensors ---------------------------------------------------------------------------


def _tiled_to_grouped(array: np.ndarray, axis: int, groups: int, per_group: int, width: int) -> np.ndarray:
    """Value heads along `axis` (each `width` wide) from llama.cpp's tiled order (head j of
    key group g at j * groups + g) back to HF's grouped order (g * per_group + j)."""
    shape = array.shape
    split = shape[:axis] + (per_group, groups, width) + shape[axis + 1:]
    return np.swapaxes(array.reshape(split), axis, axis + 1).reshape(shape)


def _value_head_order(reader: GgufFile, arch: str, name: str, array: np.ndarray) -> np.ndarray:
    """qwen35's DeltaNet tensors with their value heads back in HF's order."""
    get = lambda k: int(reader.field(f"{arch}.{k}"))  # noqa: E731
    groups, v_heads = get("ssm.group_count"), get("ssm.time_step_rank")
    if groups == v_heads or arch != "qwen35":
        return array
    per_group, k_dim = v_heads // groups, get("ssm.state_size")
    v_dim = get("ssm.inner_size") // v_heads
    qk = 2 * groups * k_dim
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # only the value rows (channels) move
        v = _tiled_to_grouped(array[qk:], 0, groups, per_group, v_dim)
        return np.concatenate([array[:qk], v])
    if name.endswith("in_proj_z.weight"):
        return _tiled_to_grouped(array, 0, groups, per_group, v_dim)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return _tiled_to_grouped(array, 0, groups, per_group, 1)
    if name.endswith("out_proj.weight"):  # columns
        return _tiled_to_grouped(array, 1, groups, per_group, v_dim)
    return array


def hf_tensor(reader: GgufFile, arch: str, name: str, array: np.ndarray) -> np.ndarray:
    """A dequantized GGUF tensor (float32, numpy order) as the HF checkpoint holds `name`."""
    if arch in _ONE_PLUS_NORMS and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        array = array - np.float32(1.0)
    if arch in HYBRIDS and "linear_attn." in name:
        if name.endswith("A_log"):
            array = np.log(-array.astype(np.float64)).astype(np.float32)
        elif name.endswith("conv1d.weight"):
            array = array.reshape(array.shape[0], 1, array.shape[-1])
        array = _value_head_order(reader, arch, name, array)
    if name.endswith("shared_expert_gate.weight") and array.ndim == 1:  # llama.cpp holds it as a vector
        array = array.reshape(1, -1)
    return array


def fuse_experts(weights: dict[str, Any], layers: int, cat: Callable[[list[Any], int], Any]) -> None:
    """Each layer's stacked gate and up experts ([E, I, H] each) as one `experts.gate_up_proj`
    [E, 2I, H] (each expert's gate rows, then its up rows) and `experts.down_proj` [E, H, I]:
    what the MoE layer reads (model/layers/moe.py). In place; `cat` joins arrays on an axis."""
    for i in range(layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_proj" in weights:
            weights[p + "gate_up_proj"] = cat([weights.pop(p + "gate_proj"), weights.pop(p + "up_proj")], 1)


def regroup_qkvz(reader: GgufFile, arch: str, weights: dict[str, Any], cat: Callable[[list[Any], int], Any]) -> None:
    """qwen3next: `in_proj_qkv` (q, k, v blocks) and `in_proj_z` back into HF's in_proj_qkvz,
    whose rows are grouped by key head (each group's q, k, v, z together). In place."""
    get = lambda k: int(reader.field(f"{arch}.{k}"))  # noqa: E731
    groups, k_dim = get("ssm.group_count"), get("ssm.state_size")
    v_group = get("ssm.inner_size") // groups  # each key group's value rows
    for name in [n for n in weights if n.endswith("linear_attn.in_proj_qkv.weight")]:
        qkv, z = weights.pop(name), weights.pop(name.replace("in_proj_qkv", "in_proj_z"))
        hidden = qkv.shape[-1]
        q, k, v = qkv[:groups * k_dim], qkv[groups * k_dim:2 * groups * k_dim], qkv[2 * groups * k_dim:]
        parts = [q.reshape(groups, k_dim, hidden), k.reshape(groups, k_dim, hidden),
                 v.reshape(groups, v_group, hidden), z.reshape(groups, v_group, hidden)]
        weights[name.replace("in_proj_qkv", "in_proj_qkvz")] = cat(parts, 1).reshape(-1, hidden)


# --- config ----------------------------------------------------------------------------


def _rope_scaling(reader: GgufFile, arch: str) -> dict[str, Any] | None:
    kind = reader.field(f"{arch}.rope.scaling.type")
    factor = reader.field(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 0, 1)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = reader.field(f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor),
                **({"original_max_position_embeddings": int(original)} if original else {})}
    raise UnsupportedCheckpoint(f"GGUF architecture {arch!r}: rope scaling {kind!r} is not supported")


def _base(reader: GgufFile, arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    get = lambda k, d=None: reader.field(f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    cfg: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length", 0)),
        "num_hidden_layers": trunk_layers(reader, arch), "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": tied, "torch_dtype": "float32",
    }
    if (scaling := _rope_scaling(reader, arch)) is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _gemma3(reader: GgufFile, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    window = int(reader.field(f"{arch}.attention.sliding_window", 0) or 0)
    n = cfg["num_hidden_layers"]
    # llama.cpp: one global layer every 6 where the file sets a window, else every layer global
    kinds = ["sliding_attention" if window and (i + 1) % 6 else "full_attention" for i in range(n)]
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    out = {**cfg, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "hidden_activation": "gelu_pytorch_tanh", "layer_types": kinds, "sliding_window": window or None,
           "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": scalar}
    cap = reader.field(f"{arch}.final_logit_softcapping")
    if cap:
        out["final_logit_softcapping"] = float(cap)
    return out


def _experts(reader: GgufFile, arch: str, layers: int) -> dict[str, Any]:
    get = lambda k, d=None: reader.field(f"{arch}.{k}", d)  # noqa: E731
    routed = {int(m.group(1)) for t in reader.tensors if (m := re.fullmatch(r"blk\.(\d+)\.ffn_gate_inp\.weight", t.name))}
    return {"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length", 0) or 0),
            # llama.cpp's qwen3moe / qwen3next graphs renormalize the chosen experts' weights
            "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if i not in routed]}


def _layer_types(reader: GgufFile, arch: str, layers: int) -> list[str]:
    """Which layers are DeltaNet layers: those whose tensors are (`ssm_a`), the rest full attention."""
    linear = {int(m.group(1)) for t in reader.tensors if (m := re.fullmatch(r"blk\.(\d+)\.ssm_a", t.name))}
    return ["linear_attention" if i in linear else "full_attention" for i in range(layers)]


def _hybrid(reader: GgufFile, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    get = lambda k, d=None: reader.field(f"{arch}.{k}", d)  # noqa: E731
    v_heads = int(get("ssm.time_step_rank"))
    rotary = int(get("rope.dimension_count", cfg["head_dim"]))
    out = {**cfg, "hidden_act": "silu", "attn_output_gate": True,
           "layer_types": _layer_types(reader, arch, cfg["num_hidden_layers"]),
           "partial_rotary_factor": rotary / cfg["head_dim"],
           "linear_conv_kernel_dim": int(get("ssm.conv_kernel")), "linear_key_head_dim": int(get("ssm.state_size")),
           "linear_num_key_heads": int(get("ssm.group_count")), "linear_num_value_heads": v_heads,
           "linear_value_head_dim": int(get("ssm.inner_size")) // v_heads}
    if arch == "qwen35":
        return {**out, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
    shared = int(get("expert_shared_feed_forward_length", 0) or 0)
    return {**out, **_experts(reader, arch, cfg["num_hidden_layers"]), "shared_expert_intermediate_size": shared,
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}


def hf_config(reader: GgufFile, arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """The HF config.json of a gemma3 / qwen3moe / qwen35 / qwen3next GGUF."""
    cfg = _base(reader, arch, vocab_size, tied)
    if arch == "gemma3":
        return _gemma3(reader, arch, cfg)
    if arch == "qwen3moe":
        return {**cfg, **_experts(reader, arch, cfg["num_hidden_layers"]), "hidden_act": "silu", "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe"}
    if arch in HYBRIDS:
        return _hybrid(reader, arch, cfg)
    raise UnsupportedCheckpoint(f"GGUF architecture {arch!r} is not supported")


def token_ids(reader: GgufFile) -> Iterator[tuple[str, int]]:
    for key in ("bos_token_id", "eos_token_id"):
        value = reader.field(f"tokenizer.ggml.{key}")
        if value is not None:
            yield key, int(value)
