"""Convert a GGUF file (llama / qwen2 / qwen3 architectures) into an HF-style directory.

The file is read with model/loading/gguf_file.py; tensors are dequantized to float32 (Q4_0, Q4_1 and
Q8_0 from their blocks, other types with the `gguf` package); llama.cpp's tensor names
map to HF names, and the rotary row permutation that llama.cpp's converter applies to
llama-architecture q/k projections is undone. The tokenizer is rebuilt from the GGUF's
byte-level BPE vocabulary and merges with the `tokenizers` library.
"""

from __future__ import annotations

import json
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
from prelude.model.loading.gguf_file import GgufFile
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

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def hf_name(gguf_name: str) -> str:
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
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; convert the model to a HF directory instead")


def build_tokenizer(reader: GgufFile) -> tuple[Tokenizer, dict[str, Any]]:
    """The HF tokenizer and a tokenizer_config dict from `tokenizer.ggml.*` metadata."""
    kind = reader.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE, 'gpt2')")
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


def gguf_blocks(reader: GgufFile) -> dict[str, GgmlQuants]:
    """The projections stored in a block format the decode kernel reads (Q4_0, Q4_1,
    Q8_0), by HF name, rows in HF order (llama's q/k rotary permutation undone)."""
    out: dict[str, GgmlQuants] = {}
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        rows = int(t.shape[1])  # ggml dims are (K, N)
        blocks = GgmlQuants.from_gguf(t.tensor_type.name, np.asarray(t.data).reshape(rows, -1), rows)
        if blocks is None:
            continue
        name = hf_name(t.name)
        if (heads := rotary_heads(reader, name)) is not None:
            blocks = blocks.select_rows(torch.from_numpy(unpermute_rotary(np.arange(rows), heads).copy()))
        out[name] = blocks
    return out


def write_gguf_blocks(gguf_path: Path, out_dir: Path) -> None:
    """Keep the GGUF's block-format projections beside its converted weights (an empty
    file when it has none, so that a converted directory is never revisited)."""
    save_blocks(gguf_blocks(GgufFile(gguf_path)), out_dir / BLOCKS_FILE)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json,
    and the block-format projections (ggml_quants.BLOCKS_FILE)."""
    reader = GgufFile(gguf_path)
    blocks = gguf_blocks(reader)  # rows already in HF order
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name in blocks:  # expanded from its blocks: bit-equal to gguf's dequantizer, and faster
            weights[name] = blocks[name].dequantize().contiguous()
            continue
        array = gguf_dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if (heads := rotary_heads(reader, name)) is not None:
            array = unpermute_rotary(array, heads)
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
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
