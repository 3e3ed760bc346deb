"""Convert a GGUF file (llama, qwen2, qwen3, qwen3moe, gemma3, qwen35, qwen3next) into an
HF-style directory.

The file is read with model/loading/gguf_file.py; tensors are dequantized to float32 (Q4_0, Q4_1 and
Q8_0 from their blocks, other types with the `gguf` package); llama.cpp's tensor names
map to HF names, and what llama.cpp's converter changed in the values is undone: the rotary
row permutation of llama-architecture q/k projections here, the other architectures'
conventions in gguf_arch.py. The tokenizer is rebuilt from the GGUF's vocabulary with the
`tokenizers` library: byte-level BPE with its merges, or a sentencepiece vocabulary
(gguf_spm.py).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize  # types without block code here
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers import normalizers

from prelude.kernels.ggml_quants import BLOCKS_FILE, GgmlQuants, save_blocks
from prelude.model.base import UnsupportedCheckpoint
from prelude.model.loading import gguf_arch
from prelude.model.loading.gguf_file import GgufFile, GgufTensor
from prelude.model.loading.gguf_spm import spm_tokenizer
from prelude.model.registry import gguf_architecture

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Split patterns of the byte-level BPE families, by GGUF `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: letters with their combining marks in one piece
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Architectures whose tensors are named and stored as llama's (here); the others: gguf_arch.py
_LLAMA_LIKE = ("llama", "qwen2", "qwen3")

logger = logging.getLogger("prelude.model.loading.gguf_convert")

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def hf_name(gguf_name: str, arch: str = "llama", layers: int | None = None) -> str | None:
    """The HF name of a GGUF tensor (None: a block past `layers`, left out)."""
    if arch not in _LLAMA_LIKE:
        return gguf_arch.hf_name(arch, gguf_name, layers)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _GLOBAL_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name}")
    return f"{_GLOBAL_NAMES[stem]}.{kind}"


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows of q/k)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(reader: GgufFile, vocab_size: int, tied: bool) -> dict[str, Any]:
    arch = str(reader.field("general.architecture"))
    architecture = gguf_architecture(arch)  # refuses what no architecture file computes
    if arch not in _LLAMA_LIKE:
        return gguf_arch.hf_config(reader, arch, vocab_size, tied) | dict(gguf_arch.token_ids(reader))
    get = lambda k, d=None: reader.field(f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    cfg: dict[str, Any] = {
        "architectures": [architecture.name],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id"):
        value = reader.field(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def _pre_tokenizer(pre: str) -> tuple[Any, Any]:
    """(normalizer, pre-tokenizer) of a byte-level BPE family."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("gpt2", "default", "smollm", "starcoder", "refact"):
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre in ("smollm", "starcoder", "refact"):
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        return None, pre_tokenizers.Sequence(steps)
    if pre in ("llama-bpe", "llama3"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        return None, pre_tokenizers.Sequence([split, byte_level])
    if pre in ("qwen2", "qwen35"):
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT if pre == "qwen2" else _QWEN35_SPLIT), behavior="isolated",
                                     invert=False)
        return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; convert the model to a HF directory instead")


def build_tokenizer(reader: GgufFile) -> tuple[Tokenizer, dict[str, Any]]:
    """The HF tokenizer and a tokenizer_config dict from `tokenizer.ggml.*` metadata."""
    kind = reader.field("tokenizer.ggml.model")
    if kind == "llama":
        return spm_tokenizer(reader)
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (byte-level BPE 'gpt2', sentencepiece 'llama')")
    tokens: list[str] = list(reader.field("tokenizer.ggml.tokens"))
    types: list[int] = list(reader.field("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in reader.field("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    normalizer, pre = _pre_tokenizer(str(reader.field("tokenizer.ggml.pre", "gpt2")))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=ty == TOKEN_TYPE_CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_tokens(added)
    name = lambda key: tokens[int(reader.field(key))] if reader.field(key) is not None else None  # noqa: E731
    bos, eos = name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id")
    add_bos = bool(reader.field("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": add_bos,
        "chat_template": reader.field("tokenizer.chat_template"),
        "model_max_length": int(reader.field(f"{reader.field('general.architecture')}.context_length", 2048)),
    }
    return tok, config


def rotary_heads(reader: GgufFile, name: str) -> int | None:
    """The head count whose rotary halves llama.cpp interleaved in this tensor's rows
    (llama-architecture q/k projections, by HF name), else None: rows to leave alone."""
    arch = str(reader.field("general.architecture"))
    if arch != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    n_heads = int(reader.field(f"{arch}.attention.head_count"))
    return n_heads if "q_proj" in name else int(reader.field(f"{arch}.attention.head_count_kv", n_heads))


def _expert_blocks(t: GgufTensor) -> GgmlQuants | None:
    """A 3-D expert tensor [E, N, K] in blocks as one weight of E x N rows (expert e's rows
    at e N .. (e + 1) N - 1); None for a type the kernel does not read."""
    experts, rows = int(t.shape[2]), int(t.shape[1])
    return GgmlQuants.from_gguf(t.tensor_type.name, np.asarray(t.data).reshape(experts * rows, -1), experts * rows)


def _interleave_experts(gate: GgmlQuants, up: GgmlQuants, experts: int) -> GgmlQuants:
    """Stacked gate and up experts as one weight whose expert e holds its gate rows, then
    its up rows (the row order of the MoE layer's `experts.gate_up_proj`)."""
    join = lambda a, b: torch.cat([a.reshape(experts, -1, *a.shape[1:]),  # noqa: E731
                                   b.reshape(experts, -1, *b.shape[1:])], dim=1).reshape(-1, *a.shape[1:])
    return GgmlQuants(gate.kind, join(gate.qs, up.qs), join(gate.d, up.d),
                      None if gate.m is None or up.m is None else join(gate.m, up.m))


def gguf_blocks(reader: GgufFile) -> dict[str, GgmlQuants]:
    """The projections stored in a block format the decode kernel reads (Q4_0, Q4_1,
    Q8_0), by HF name, rows in HF order (llama's q/k rotary permutation undone); a mixture's
    experts as `experts.gate_up_proj` and `experts.down_proj` (each expert's rows in turn).
    None for the hybrid architectures, whose layers read no blocks: their weights are the
    float32 expansion alone."""
    arch = str(reader.field("general.architecture"))
    if arch in gguf_arch.HYBRIDS:
        quantized = sum(t.tensor_type.name not in ("F32", "F16", "BF16") for t in reader.tensors)
        if quantized:
            logger.info("%s: %d quantized tensors served from their float32 expansion (the hybrid layers read no "
                        "GGUF blocks)", arch, quantized)
        return {}
    layers = gguf_arch.trunk_layers(reader, arch) if arch not in _LLAMA_LIKE else None
    out: dict[str, GgmlQuants] = {}
    for t in reader.tensors:
        if len(t.shape) == 3:
            name = hf_name(t.name, arch, layers)
            if name is not None and (blocks := _expert_blocks(t)) is not None:
                out[name] = blocks
            continue
        if len(t.shape) != 2:
            continue
        rows = int(t.shape[1])  # ggml dims are (K, N)
        blocks = GgmlQuants.from_gguf(t.tensor_type.name, np.asarray(t.data).reshape(rows, -1), rows)
        if blocks is None:
            continue
        name = hf_name(t.name, arch, layers)
        if name is None:
            continue
        if (heads := rotary_heads(reader, name)) is not None:
            blocks = blocks.select_rows(torch.from_numpy(unpermute_rotary(np.arange(rows), heads).copy()))
        out[name] = blocks
    for name in [n for n in out if n.endswith("mlp.experts.gate_proj")]:
        gate, up = out.pop(name), out.pop(name.replace("gate_proj", "up_proj"), None)
        # kept only where both are of one kind (one kernel call reads them together)
        if up is not None and up.kind == gate.kind and up.out_features == gate.out_features:
            experts = int(reader.field(f"{arch}.expert_count"))
            out[name.replace("gate_proj", "gate_up_proj")] = _interleave_experts(gate, up, experts)
    out = {n: b for n, b in out.items() if not n.endswith("mlp.experts.up_proj")}
    return out


def write_gguf_blocks(gguf_path: Path, out_dir: Path) -> None:
    """Keep the GGUF's block-format projections beside its converted weights (an empty
    file when it has none, so that a converted directory is never revisited)."""
    save_blocks(gguf_blocks(GgufFile(gguf_path)), out_dir / BLOCKS_FILE)


def check_gguf(reader: GgufFile) -> None:
    """Refuse in one line (UnsupportedCheckpoint), from the header alone, a GGUF whose
    architecture, tensors or config no architecture file computes."""
    from prelude.model.registry import config_for

    arch = str(reader.field("general.architecture"))
    gguf_architecture(arch)
    if arch in _LLAMA_LIKE:
        return
    layers = gguf_arch.trunk_layers(reader, arch)
    names = {hf_name(t.name, arch, layers) for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise UnsupportedCheckpoint(f"GGUF architecture {arch!r}: the file has no token_embd.weight")
    config_for(hf_config(reader, int(embed.shape[1]), "lm_head.weight" not in names))


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(parts, dim=dim)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json,
    and the block-format projections (ggml_quants.BLOCKS_FILE)."""
    reader = GgufFile(gguf_path)
    arch = str(reader.field("general.architecture"))
    check_gguf(reader)  # refuses what no architecture file computes, before any work
    layers = gguf_arch.trunk_layers(reader, arch) if arch not in _LLAMA_LIKE else None
    blocks = gguf_blocks(reader)  # rows already in HF order
    weights: dict[str, torch.Tensor] = {}
    left_out = 0
    for t in reader.tensors:
        name = hf_name(t.name, arch, layers)
        if name is None:
            left_out += 1
            continue
        if name in blocks:  # expanded from its blocks: bit-equal to gguf's dequantizer, and faster
            # (stacked experts [E, N, K] come back in the shape they were stored in)
            weights[name] = blocks[name].dequantize().reshape(tuple(reversed(t.shape))).contiguous()
            continue
        array = gguf_dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if (heads := rotary_heads(reader, name)) is not None:
            array = unpermute_rotary(array, heads)
        if arch not in _LLAMA_LIKE:
            array = gguf_arch.hf_tensor(reader, arch, name, array)
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
    if left_out:
        logger.info("%s: the multi-token-prediction head (%d tensors) left out: the engine serves the text model",
                    gguf_path.name, left_out)
    if arch not in _LLAMA_LIKE:
        gguf_arch.fuse_experts(weights, layers or 0, _cat)
        if arch == "qwen3next":
            gguf_arch.regroup_qkvz(reader, arch, weights, _cat)
    tokenizer, tok_cfg = build_tokenizer(reader)
    tied = "lm_head.weight" not in weights
    cfg = hf_config(reader, weights["model.embed_tokens.weight"].shape[0], tied)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"))
    save_blocks(blocks, out_dir / BLOCKS_FILE)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps({k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}, indent=2)
    )
