"""BERT-style bidirectional encoders (sentence embeddings, cross-encoder rerankers).

Encoders have no KV cache and no generation: every request is OneShot. Handles
`BertModel` checkpoints (sentence-transformers layout, pooling from 1_Pooling/) and
`BertForSequenceClassification` (pooler + classifier head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from prelude.model.attention.bidirectional import BidirectionalAttention
from prelude.model.attention.metadata import AttentionMetadata
from prelude.model.arch import hf_config
from prelude.model.base import Architecture, EncoderWithoutKV, KVCaches, UnsupportedCheckpoint
from prelude.model.sentence_modules import pooling_of

# Tensors some checkpoints carry that no forward reads (position id buffers)
_NEVER_READ = ("embeddings.position_ids",)
_NO_KV = torch.empty(0)  # what the attention is handed for a cache: it keeps none


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    id2label: tuple[str, ...]
    default_pooling: str  # from sentence-transformers' pooling config when present
    default_normalize: bool
    architecture: str = "BertModel"  # HF `architectures` (model/registry.py)

    @staticmethod
    def from_dir(model_dir: Path, cfg: dict[str, Any]) -> "EncoderConfig":
        pooling, normalize = "cls", False
        pool_cfg = model_dir / "1_Pooling" / "config.json"
        if pool_cfg.exists():  # the runner takes the whole module stack (model/sentence_modules.py)
            pooling = pooling_of(model_dir, json.loads(pool_cfg.read_text()))[0]
        max_len = int(cfg.get("max_position_embeddings", 512))
        st_cfg = model_dir / "sentence_bert_config.json"
        if st_cfg.exists():  # sentence-transformers truncates there: inputs beyond it are refused
            max_len = min(max_len, int(json.loads(st_cfg.read_text()).get("max_seq_length", max_len)))
        modules = model_dir / "modules.json"
        if modules.exists():
            normalize = any(m.get("type", "").endswith("Normalize") for m in json.loads(modules.read_text()))
        from prelude.config import _is_classifier, _labels

        return EncoderConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=max_len,
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=str(cfg.get("hidden_act", "gelu")),
            id2label=_labels(cfg) if _is_classifier(cfg) else (),
            default_pooling=pooling,
            default_normalize=normalize,
            architecture=str((cfg.get("architectures") or ["BertModel"])[0]),
        )


_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> EncoderConfig:
    name = str((raw.get("architectures") or ["BertModel"])[0])
    hf_config.require(name, raw, "hidden_act", _ACTIVATIONS, "gelu")
    hf_config.require(name, raw, "position_embedding_type", ("absolute",), "absolute")
    hf_config.refuse_unhandled(name, raw)
    return EncoderConfig.from_dir(model_dir if model_dir is not None else Path("/nonexistent"), raw)


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(x)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unsupported activation {name!r}")


class BertEncoder(EncoderWithoutKV):
    is_encoder = True
    computes_read_positions = False  # bidirectional: every layer reads every position
    can_generate = False

    def __init__(
        self, config: EncoderConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        w = {k.removeprefix("bert."): v.to(dtype=dtype, device=self.device) for k, v in weights.items()
             if k.removeprefix("bert.") not in _NEVER_READ}
        _check_names(config, w)
        self.w = w
        self.default_pooling = config.default_pooling
        self.layers = range(config.num_hidden_layers)
        self.has_pooler = "pooler.dense.weight" in w
        self.has_classifier = "classifier.weight" in w
        self.attention = BidirectionalAttention()
        # q, k and v of a layer as one projection (moved out of `w`, not copied twice).
        attn = "encoder.layer.{}.attention.self.{}."
        self.qkv: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.cat([w.pop(attn.format(i, n) + "weight") for n in ("query", "key", "value")]),
             torch.cat([w.pop(attn.format(i, n) + "bias") for n in ("query", "key", "value")]))
            for i in self.layers
        ]

    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[prefix + ".weight"], self.w[prefix + ".bias"], self.config.layer_norm_eps)

    def _lin(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self.w.get(prefix + ".bias"))

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row (a `meta.prefills` slice) attends bidirectionally to itself; returns
        flattened hidden [T, H]. No KV is kept: `kv_caches` is empty. Projections run once
        over every token of every row; attention on the rows padded to the longest
        (model/attention/bidirectional.py)."""
        cfg = self.config
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        h = (
            self.w["embeddings.word_embeddings.weight"][input_ids]
            + self.w["embeddings.position_embeddings.weight"][positions]
            + self.w["embeddings.token_type_embeddings.weight"][types]
        )
        h = self._ln(h, "embeddings.LayerNorm")
        heads, dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        for i in self.layers:
            p = f"encoder.layer.{i}."
            q, k, v = F.linear(h, self.qkv[i][0], self.qkv[i][1]).view(-1, 3, heads, dim).unbind(1)
            a = self.attention.forward(q, k, v, _NO_KV, _NO_KV, meta, dim**-0.5).reshape(h.shape[0], -1)
            h = self._ln(self._lin(a, p + "attention.output.dense") + h, p + "attention.output.LayerNorm")
            m = _act(cfg.hidden_act, self._lin(h, p + "intermediate.dense"))
            h = self._ln(self._lin(m, p + "output.dense") + h, p + "output.LayerNorm")
        self.attention.release()
        return h

    @torch.inference_mode()
    def classify(self, hidden_row: torch.Tensor) -> torch.Tensor:
        """Cross-encoder / classifier head on the [CLS] token -> [labels] (float32)."""
        if not self.has_classifier:
            raise RuntimeError("this encoder has no classification head")
        cls = hidden_row[0]
        if self.has_pooler:
            cls = torch.tanh(self._lin(cls, "pooler.dense"))
        return self._lin(cls, "classifier").float()


    def make_packed_copies(self) -> int:
        return 0  # its projections are plain F.linear calls


def _check_names(config: EncoderConfig, weights: dict[str, torch.Tensor]) -> None:
    """Refuse tensors the forward would not read, and missing ones, by name."""
    per_layer = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                 "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
    expected = {f"embeddings.{n}.weight" for n in ("word_embeddings", "position_embeddings", "token_type_embeddings")}
    expected |= {"embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"}
    expected |= {f"encoder.layer.{i}.{n}.{kind}" for i in range(config.num_hidden_layers) for n in per_layer
                 for kind in ("weight", "bias")}
    optional = {f"{n}.{kind}" for n in ("pooler.dense", "classifier") for kind in ("weight", "bias")}
    missing = sorted(expected - weights.keys())
    unread = sorted(weights.keys() - expected - optional)
    if missing:
        raise UnsupportedCheckpoint(f"architecture {config.architecture}: the checkpoint has no tensor {missing[0]}")
    if unread:
        raise UnsupportedCheckpoint(f"architecture {config.architecture}: the checkpoint's tensors "
                                    f"{', '.join(unread[:3])} are not read by this architecture")


def _build(config: EncoderConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
           **_unused: Any) -> BertEncoder:
    return BertEncoder(config, weights, dtype, device)  # bidirectional, no paged KV: no attention backend


ARCHITECTURES = tuple((Architecture(name, "bert", _config, _build), types)
                      for name, types in (("BertModel", ("bert",)), ("BertForSequenceClassification", ())))
