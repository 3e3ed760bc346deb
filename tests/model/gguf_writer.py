"""Write a random-weight transformers model as a GGUF file the way llama.cpp's converter
(convert_hf_to_gguf.py) writes its architecture: llama.cpp's tensor names (from the gguf
package's name map), its metadata keys, and the value conventions it applies:
- gemma3, qwen35: RMSNorm weights stored with the 1 of (1 + w) added (not the DeltaNet's
  gated norm);
- qwen3moe: experts stacked per layer as ffn_gate_exps / ffn_up_exps / ffn_down_exps;
- qwen35: A_log stored as -exp(A_log), conv1d squeezed, dt_bias as ssm_dt.bias, and the
  value heads of the DeltaNet tensors moved from grouped (by key head) to tiled order;
- qwen3next: the same values (no value-head reordering), in_proj_qkvz split into
  attn_qkv and attn_gate, experts stacked, the shared expert's gate a vector.
Written independently of the loader's inverse (model/loading/gguf_arch.py), so a test that
loads the file checks both against the same published conventions.

Quantized files quantize the projections (2-D and 3-D weights whose rows are a multiple of
32) and keep norms, routers and the DeltaNet's small tensors in F32, as llama.cpp's
quantizer does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

# A byte-level BPE vocabulary (GPT-2's byte alphabet) of `size` tokens: the 256 bytes, a few
# merges, then control tokens at the end.
_BYTE_CHARS = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(ord("¡"), ord("¬") + 1)] + \
    [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]


def _byte_alphabet() -> list[str]:
    chars = list(_BYTE_CHARS)
    printable = {ord(c) for c in chars}
    extra = 0
    out = {}
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def bpe_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary with `size` tokens, the
    last two control tokens (`<|endoftext|>`, `<|im_end|>`)."""
    alphabet = _byte_alphabet()
    tokens = list(alphabet)
    merges: list[str] = []
    sp = alphabet[ord(" ")]
    # in an order BPE training gives: every token reachable through the merges before it
    for pair in [("t", "h"), ("th", "e"), (sp, "the"), ("i", "n"), (sp, "in"), ("a", "n"), ("an", "d"), (sp, "and"),
                 ("e", "r"), ("o", "n"), ("r", "e"), ("o", "u"), (sp, "t"), ("e", "n"), ("i", "s"), (sp, "a")]:
        if len(tokens) >= size - 2:
            break
        merges.append(" ".join(pair))
        tokens.append("".join(pair))
    while len(tokens) < size - 2:
        tokens.append(f"<unused{len(tokens)}>")
    tokens += ["<|endoftext|>", "<|im_end|>"]
    types = [1] * (size - 2) + [3, 3]
    types = [4 if t.startswith("<unused") else ty for t, ty in zip(tokens, types)]
    return tokens, types, merges


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a Gemma-style sentencepiece vocabulary: <pad>,
    <eos>, <bos>, <unk>, the 256 byte tokens, letters and a few merged pieces, a token of two
    spaces spelled with real spaces (as Gemma files store it)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [3, 3, 3, 2]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581", "t", "h", "e", "a", "n", "d", "i", "s", "o", "r", "\u2581t", "th", "he", "\u2581th", "the",
              "\u2581the", "an", "nd", "and", "\u2581and", "in", "is", "\u2581a", "er", "on", "  ", "re", "\u2581i",
              "\u2581is", "or"]
    for p in pieces:
        if len(tokens) >= size:
            break
        tokens.append(p)
        types.append(1)
    while len(tokens) < size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(4)
    scores = [-float(i) for i in range(size)]
    return tokens, scores, types


def _reorder_v_heads(t: torch.Tensor, dim: int, groups: int, per_group: int, width: int) -> torch.Tensor:
    """Grouped value heads (head j of key group g at g * per_group + j) to tiled order
    (j * groups + g) along `dim`, as llama.cpp's Qwen3.5 converter stores them."""
    shape = list(t.shape)
    split = shape[:dim] + [groups, per_group, width] + shape[dim + 1:]
    return t.reshape(split).transpose(dim, dim + 1).reshape(shape)


def _qwen35_tensor(name: str, t: torch.Tensor, cfg: Any) -> tuple[str, torch.Tensor]:
    groups, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    per, kd, vd = v_heads // groups, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if "linear_attn." in name and groups != v_heads:
        qk = 2 * groups * kd
        if name.endswith("in_proj_qkv.weight"):
            t = torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, groups, per, vd)])
        elif name.endswith("conv1d.weight"):
            t = torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, groups, per, vd)])
        elif name.endswith("in_proj_z.weight"):
            t = _reorder_v_heads(t, 0, groups, per, vd)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight")):
            t = _reorder_v_heads(t, 0, groups, per, 1)
        elif name.endswith(("A_log", "dt_bias")):
            t = _reorder_v_heads(t.unsqueeze(-1), 0, groups, per, 1).squeeze(-1)
        elif name.endswith("out_proj.weight"):
            t = _reorder_v_heads(t, 1, groups, per, vd)
    if name.endswith("A_log"):
        t = -torch.exp(t.double()).float()
    elif name.endswith("dt_bias"):
        name = name.replace("dt_bias", "dt_proj.bias")
    elif name.endswith("conv1d.weight"):
        t = t.squeeze(1)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return name, t


def _qwen3next_tensors(name: str, t: torch.Tensor, cfg: Any) -> list[tuple[str, torch.Tensor]]:
    """Qwen3-Next: in_proj_qkvz (rows grouped by key head: q, k, v, z) split into the q, k, v
    blocks (`in_proj_qkv`) and z (`in_proj_z`); the shared expert's gate a vector; the
    values as for Qwen3.5 but with no value-head reordering."""
    if name.endswith("in_proj_qkvz.weight"):
        groups, kd = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        vg = cfg.linear_num_value_heads // groups * cfg.linear_value_head_dim
        q, k, v, z = t.reshape(groups, -1, t.shape[-1]).split([kd, kd, vg, vg], dim=1)
        flat = lambda x: x.reshape(-1, t.shape[-1])  # noqa: E731
        base = name.removesuffix("in_proj_qkvz.weight")
        return [(base + "in_proj_qkv.weight", torch.cat([flat(q), flat(k), flat(v)])), (base + "in_proj_z.weight", flat(z))]
    if name.endswith("shared_expert_gate.weight"):
        return [(name, t.reshape(-1))]
    groups = cfg.linear_num_key_heads
    flat_cfg = type("Cfg", (), {**{k: getattr(cfg, k) for k in ("linear_key_head_dim", "linear_value_head_dim")},
                                "linear_num_key_heads": groups, "linear_num_value_heads": groups})  # no reorder
    return [_qwen35_tensor(name, t, flat_cfg)]


def _tensors(model: Any, arch: str) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors under their (HF) names, with llama.cpp's value conventions applied."""
    cfg = model.config
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1
        if arch in ("qwen3moe", "qwen3next") and name.endswith("mlp.experts.gate_up_proj"):
            inter = t.shape[1] // 2
            base = name.removesuffix("gate_up_proj")
            out += [(base + "gate_proj.weight", t[:, :inter]), (base + "up_proj.weight", t[:, inter:])]
            continue
        if arch in ("qwen3moe", "qwen3next") and name.endswith("mlp.experts.down_proj"):
            name += ".weight"
        if arch == "qwen35":
            name, t = _qwen35_tensor(name, t, cfg)
        if arch == "qwen3next":
            out += _qwen3next_tensors(name, t, cfg)
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out.append((name, t))
    return out


def _gguf_name(name_map: gguf.TensorNameMap, name: str) -> str:
    for suffix in (".weight", ".bias", ""):
        if name.endswith(suffix):
            found = name_map.get_name(name[: len(name) - len(suffix)] if suffix else name)
            if found is not None:
                return found + suffix
    raise KeyError(name)


def _quantized(gguf_name: str, t: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> bool:
    if qtype == gguf.GGMLQuantizationType.F32 or t.dim() < 2:
        return False
    if any(k in gguf_name for k in ("norm", "gate_inp", "ssm_conv1d")):
        return False
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return t.shape[-1] % block == 0


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: Any, mtp_layers: int) -> None:
    w.add_block_count(cfg.num_hidden_layers + mtp_layers)
    if mtp_layers:
        w.add_uint32(f"{arch}.nextn_predict_layers", mtp_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch == "gemma3":
        w.add_rope_freq_base(rope.get("full_attention", {}).get("rope_theta", 1_000_000.0))
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
        full = rope.get("full_attention", {})
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    if arch in ("qwen3moe", "qwen3next"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen3next":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch in ("qwen35", "qwen3next"):
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        w.add_ssm_state_size(cfg.linear_key_head_dim)
        w.add_ssm_group_count(cfg.linear_num_key_heads)
        w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        w.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
        w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch == "qwen35":
        w.add_rope_dimension_sections([11, 11, 10, 0])


def _tokenizer(w: gguf.GGUFWriter, arch: str, vocab_size: int) -> None:
    if arch == "gemma3":
        tokens, scores, types = spm_vocab(vocab_size)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        return
    tokens, types, merges = bpe_vocab(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35" if arch == "qwen35" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab_size - 1)
    w.add_bos_token_id(vocab_size - 2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")


def write_gguf(model: Any, arch: str, path: Path,
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               extra: dict[str, np.ndarray] | None = None, mtp_layers: int = 0) -> Path:
    """`model` (a transformers causal LM of `arch`'s family) as a GGUF at `path`: the
    projections in `qtype` (F32, F16, BF16 or a block type), the rest in F32. `extra`:
    more tensors by GGUF name; `mtp_layers`: that many of them are trailing blocks of a
    multi-token-prediction head (counted in block_count, as llama.cpp writes them)."""
    cfg = model.config
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, cfg, mtp_layers)
    _tokenizer(w, arch, cfg.vocab_size)
    for name, t in _tensors(model, arch):
        gname = _gguf_name(name_map, name)
        array = t.numpy().astype(np.float32)
        if _quantized(gname, t, qtype):
            if qtype == gguf.GGMLQuantizationType.F16:
                w.add_tensor(gname, array.astype(np.float16))
            else:
                w.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, array)
    for gname, array in (extra or {}).items():
        w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_like_file(model: Any, arch: str, qtype: gguf.GGMLQuantizationType) -> Any:
    """`model` with each weight the GGUF file of `qtype` holds replaced by its dequantized
    value (the weights a correct loader of that file computes with), in place."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return model
    params = dict(model.named_parameters())
    cfg = model.config
    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                        cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in params.items():
            probe = name if not name.endswith("gate_up_proj") else name.removesuffix("gate_up_proj") + "gate_proj.weight"
            probe = probe if not name.endswith("experts.down_proj") else name + ".weight"
            try:
                gname = _gguf_name(name_map, probe.replace("dt_bias", "dt_proj.bias"))
            except KeyError:
                continue
            t = p.detach().float()
            if not _quantized(gname, t, qtype):
                continue
            if qtype == gguf.GGMLQuantizationType.F16:
                p.copy_(t.half().float())
                continue
            flat = t.numpy().astype(np.float32)
            back = gguf.quants.dequantize(gguf.quants.quantize(flat, qtype), qtype).reshape(flat.shape)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return model
