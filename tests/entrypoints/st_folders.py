"""Random-weight sentence-transformers folders on decoder backbones, written as they ship:
the trunk's config and weights, a tokenizer, modules.json with Pooling / Dense / Normalize,
config_sentence_transformers.json with prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

WORDS = ["<pad>", "<unk>", "<eos>"] + [c for c in "abcdefghijklmnopqrstuvwxyz"] + [
    "paris", "france", "capital", "banana", "yellow", "is", "the", "of", "what", "fruit", "instruct", "query",
    "given", "a", "web", "search", "retrieve", "passages", ":", "document", "yes", "no", "judge", "answer"]


def write_tokenizer(path: Path, eos_suffix: bool = True) -> Any:
    """A word-level tokenizer.json (whitespace and punctuation split); with `eos_suffix` the
    post-processor appends <eos> to every text, as Qwen3-Embedding's does."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if eos_suffix:
        tok.post_processor = processors.TemplateProcessing(single="$A <eos>", pair="$A <eos> $B:1 <eos>:1",
                                                           special_tokens=[("<eos>", vocab["<eos>"])])
    tok.add_special_tokens(["<pad>", "<eos>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>", "model_max_length": 512}))
    return tok


def qwen3_config(**extra: Any) -> Any:
    import transformers

    return transformers.Qwen3Config(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=2, **extra)


def perturb_norms(model: Any) -> None:
    """Random init leaves the norms at 1: perturb them so that they are tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def write_st_folder(path: Path, *, pooling: str = "lasttoken", include_prompt: bool = True,
                    dense: tuple[tuple[int, str], ...] = (), normalize: bool = True,
                    prompts: dict[str, str] | None = None, default_prompt: str | None = None,
                    seed: int = 0, config_extra: dict[str, Any] | None = None, dense_bias: bool = True,
                    trunk: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """A Qwen3 trunk (`Qwen3Model`, saved as sentence-transformers saves it), or the one
    `trunk(config_extra)` makes, with its module stack; `dense`: (out_features, torch.nn
    activation class name) per Dense layer."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    if trunk is None:
        model = transformers.Qwen3Model(qwen3_config(**(config_extra or {}))).float().eval()
    else:
        model = trunk(config_extra or {})
    perturb_norms(model)
    model.save_pretrained(path)
    hidden = int(model.config.hidden_size)
    write_tokenizer(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": hidden, "pooling_mode": pooling, "include_prompt": include_prompt}))
    width = hidden
    for i, (out, act) in enumerate(dense, start=2):
        folder = path / f"{i}_Dense"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"in_features": width, "out_features": out, "bias": dense_bias,
                                                        "activation_function": f"torch.nn.modules.activation.{act}"
                                                        if act != "Identity" else "torch.nn.modules.linear.Identity"}))
        tensors = {"linear.weight": torch.randn(out, width) * 0.2, "linear.bias": torch.randn(out) * 0.1}
        save_file(tensors if dense_bias else {"linear.weight": tensors["linear.weight"]},
                  str(folder / "model.safetensors"))
        modules.append({"idx": i, "name": str(i), "path": folder.name, "type": "sentence_transformers.models.Dense"})
        width = out
    if normalize:
        n = len(modules)
        (path / f"{n}_Normalize").mkdir()
        modules.append({"idx": n, "name": str(n), "path": f"{n}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts or {}, "default_prompt_name": default_prompt, "similarity_fn_name": "cosine"}))
    return model
