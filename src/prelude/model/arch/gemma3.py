"""Gemma 3 (text): `Gemma3ForCausalLM`, its classifiers, and the language model inside
`Gemma3ForConditionalGeneration` checkpoints (the vision tower's tensors are skipped).

Its layer differs from Llama's in: RMSNorms that scale by (1 + w) in float32 before the
cast back; a sandwich of four norms a layer (input, after attention, before and after the
MLP) plus per-head q/k norms; embeddings scaled by sqrt(hidden) in the model's dtype; a
GELU-tanh gated MLP; the attention scale query_pre_attn_scalar ** -0.5; sliding-window
layers interleaved with global ones (`layer_types`, or one global layer every
`sliding_window_pattern`), each kind with its own RoPE base and scaling; a soft-cap of the
final logits where set. The forward is composed here over the trunk's weights
(model/decoder.py); the global layers attend through the configured backend, the sliding
ones through the torch backend with the window applied as a mask (the C and Triton kernels
take no window). Every layer keeps the whole context's KV; the context is not capped by
the window (global layers see everything).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from prelude.config import ModelConfig
from prelude.model.arch import hf_config
from prelude.model.attention.metadata import AttentionMetadata
from prelude.model.attention.torch_backend import TorchAttention
from prelude.model.base import Architecture, KVCaches, UnsupportedCheckpoint
from prelude.model.decoder import Decoder
from prelude.model.layers.decoder_segments import EAGER_SEGMENTS, DecoderSegments, gelu_tanh, linear, rotate
from prelude.model.layers.rotary import RotaryEmbedding
from prelude.model.lora.adapters import LoraStep
from prelude.model.read_positions import ReadPositions
from prelude.model.spec import AttentionSpec, DecoderSpec, LayerSpec, MlpSpec, RopeSpec

logger = logging.getLogger("prelude.model.gemma3")

# Tensors of a multimodal checkpoint that the text model does not read
_VISION = ("vision_tower.", "multi_modal_projector.")
# A multimodal checkpoint's names for the language model's tensors -> the text model's
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_KINDS = {"sliding_attention": "sliding", "full_attention": "full"}
# The architectures a bidirectional checkpoint may name: a trunk without a head
ENCODER_ARCHITECTURES = ("Gemma3TextModel",)


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """The decoder config with Gemma 3's own fields (`sliding_window` stays None: it is not
    a context cap here; `window` is the sliding layers')."""

    layer_kinds: tuple[str, ...] = ()  # "sliding" | "full" per layer
    window: int = 0
    local_rope_theta: float = 10000.0
    local_rope_scaling: tuple[tuple[str, Any], ...] | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcap: float | None = None
    # use_bidirectional_attention (EmbeddingGemma): every layer attends both ways, a sliding
    # layer `window // 2` tokens to each side; served as an encoder (model/arch/gemma3_encoder.py)
    bidirectional: bool = False


def _text_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: `text_config` of a multimodal checkpoint (with the
    top-level fields that decide the head), else `raw` itself."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    top = {k: raw[k] for k in ("architectures", "id2label", "label2id", "num_labels", "tie_word_embeddings",
                               "eos_token_id", "bos_token_id") if k in raw}
    return {**text, **top}


def _layer_kinds(name: str, raw: dict[str, Any]) -> tuple[str, ...]:
    n = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:  # older configs: one global layer every `sliding_window_pattern`
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in _KINDS for t in types):
        raise UnsupportedCheckpoint(f"architecture {name}: layer_types {hf_config._short(types)} is not supported "
                                    f"(one of {', '.join(_KINDS)} a layer)")
    return tuple(_KINDS[t] for t in types)


def _ropes(name: str, raw: dict[str, Any]) -> dict[str, tuple[float, tuple[tuple[str, Any], ...] | None]]:
    """(theta, scaling) per layer kind, from `rope_parameters` by layer type or the older
    `rope_theta` (global), `rope_local_base_freq` (sliding) and `rope_scaling` (global)."""
    params = raw.get("rope_parameters")
    out = {}
    for hf_kind, kind in _KINDS.items():
        if isinstance(params, dict) and isinstance(params.get(hf_kind), dict):
            out[kind] = hf_config.rope_of(name, {"rope_parameters": params[hf_kind]})
        elif kind == "full":
            out[kind] = hf_config.rope_of(name, {"rope_theta": raw.get("rope_theta", 1_000_000.0),
                                                 "rope_scaling": raw.get("rope_scaling")})
        else:
            out[kind] = (float(raw.get("rope_local_base_freq", 10_000.0)), None)
    return out


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> Gemma3Config:
    raw = _text_raw(raw)
    name = str((raw.get("architectures") or ["Gemma3ForCausalLM"])[0])
    if raw.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 attention reads the field but never applies it
        raise UnsupportedCheckpoint(f"architecture {name}: config field attn_logit_softcapping="
                                    f"{raw['attn_logit_softcapping']} is not supported (transformers' Gemma 3 does "
                                    "not apply it either)")
    hf_config.refuse_unhandled(name, raw, handled=("final_logit_softcapping", "query_pre_attn_scalar", "layer_types",
                                                   "attn_logit_softcapping", "use_bidirectional_attention"))
    bidirectional = bool(raw.get("use_bidirectional_attention"))
    if bidirectional and name not in ENCODER_ARCHITECTURES:
        raise UnsupportedCheckpoint(f"architecture {name}: config field use_bidirectional_attention=True is served "
                                    f"for the bare trunk only ({', '.join(ENCODER_ARCHITECTURES)}, an embedder)")
    hf_config.require(name, raw, "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
    kinds = _layer_kinds(name, raw)
    window = raw.get("sliding_window")
    if "sliding" in kinds and not window:
        raise UnsupportedCheckpoint(f"architecture {name}: sliding layers without a sliding_window")
    ropes = _ropes(name, raw)
    # an encoder has no language-model head, tied or not
    tied = raw.get("tie_word_embeddings", True) and not bidirectional
    base = ModelConfig.from_hf_dict({**raw, "sliding_window": None, "rope_scaling": None, "tie_word_embeddings": tied})
    cap = raw.get("final_logit_softcapping")
    return Gemma3Config(
        **{f.name: getattr(base, f.name) for f in fields(ModelConfig)} | {
            "architecture": name, "rope_theta": ropes["full"][0], "rope_scaling": ropes["full"][1]},
        layer_kinds=kinds, window=int(window or 0), local_rope_theta=ropes["sliding"][0],
        local_rope_scaling=ropes["sliding"][1], query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        final_logit_softcap=float(cap) if cap is not None else None, bidirectional=bidirectional)


def describe(config: Gemma3Config) -> DecoderSpec:
    ropes = {"full": RopeSpec(config.rope_theta, config.rope_scaling, config.head_dim),
             "sliding": RopeSpec(config.local_rope_theta, config.local_rope_scaling, config.head_dim)}
    layers = tuple(
        LayerSpec(AttentionSpec(kind, config.num_attention_heads, config.num_key_value_heads,  # type: ignore[arg-type]
                                config.head_dim, ropes[kind], config.query_pre_attn_scalar ** -0.5,
                                window=config.window if kind == "sliding" else None, qk_norm=True),
                  MlpSpec("dense", "gelu_tanh", config.intermediate_size), "rms_one_plus", config.rms_norm_eps,
                  post_norms=True)
        for kind in config.layer_kinds)
    return DecoderSpec(config.architecture, config.hidden_size, config.vocab_size, layers, "rms_one_plus",
                       embed_scale=config.hidden_size ** 0.5, final_logit_softcap=config.final_logit_softcap,
                       tie_word_embeddings=config.tie_word_embeddings)


def text_weights(weights: Mapping[str, torch.Tensor], architecture: str) -> dict[str, torch.Tensor]:
    """The language model's tensors under the text model's names; a multimodal
    checkpoint's vision tower and projector are left out (said in the log)."""
    out: dict[str, torch.Tensor] = {}
    skipped = 0
    for name, tensor in weights.items():
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if any(name.startswith(p) or name.startswith("model." + p) for p in _VISION):
            skipped += 1
            continue
        out[name] = tensor
    if skipped:
        logger.info("%s: %d vision tower and projector tensors skipped (the text model is served)", architecture,
                    skipped)
    return out


def _one_plus_norm(x: torch.Tensor, one_plus: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalized and scaled by (1 + w) in float32, then cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * one_plus).to(x.dtype)


class Gemma3ForCausalLM(Decoder):
    def __init__(self, config: Gemma3Config, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", *args: Any, max_positions: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config, describe(config), text_weights(weights, config.architecture), dtype, device, *args,
                         max_positions=max_positions, **kwargs)
        self.local_rope = RotaryEmbedding(
            replace(config, rope_theta=config.local_rope_theta, rope_scaling=config.local_rope_scaling),
            max_positions or config.max_position_embeddings, dtype, self.device)
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype)  # transformers scales in the dtype
        self.scale = config.query_pre_attn_scalar ** -0.5
        one_plus = lambda w: 1.0 + w.float()  # noqa: E731
        self._norms = [tuple(one_plus(n) for n in (layer.input_norm, layer.post_norm, layer.pre_mlp_norm,
                                                   layer.post_mlp_norm, layer.q_norm, layer.k_norm))
                       for layer in self.layers]
        self._final_norm = one_plus(self.norm)
        self._windowed = TorchAttention()
        if "sliding" in config.layer_kinds and not config.bidirectional:
            backend = getattr(self.attention, "name", "torch")
            how = ("" if backend == "torch" else
                   f" (the {backend} backend takes no window; the global layers attend through it)")
            logger.info("%s: %d of %d layers slide a %d-token window, attended through the torch backend with the "
                        "window as a mask%s; every layer keeps the whole context's KV", config.architecture,
                        config.layer_kinds.count("sliding"), len(config.layer_kinds), config.window, how)

    @staticmethod
    def _check_spec(spec: DecoderSpec) -> None:
        for i, layer in enumerate(spec.layers):
            a = layer.attention
            why = (f"{a.kind} attention" if a.kind == "linear" else
                   "attention soft-capping" if a.logit_softcap is not None else
                   "an attention output gate" if a.output_gate else
                   "partial rotary" if a.rope is None or a.rope.rotary_dim != a.head_dim else
                   f"a {layer.mlp.kind} MLP" if layer.mlp.kind != "dense" else None)
            if why is not None:
                raise UnsupportedCheckpoint(f"architecture {spec.architecture}: layer {i} has {why}, which the "
                                            "Gemma 3 forward does not compute")

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        token_type_ids: torch.Tensor | None = None,
        segments: DecoderSegments = EAGER_SEGMENTS,
        lora: LoraStep | None = None,
        reads: ReadPositions | None = None,
    ) -> torch.Tensor:
        """The decoder's forward signature (`segments` are the Llama layer's: not used
        here). Every position runs every layer; `reads` selects the rows returned."""
        if self._copies_thread is not None:
            self._copies_thread.join()
            self._copies_thread = None
        eps, shape = self.config.rms_norm_eps, self.shape
        h = self.embed.index_select(0, input_ids) * self.embed_scale
        tables = {"full": self.rope.tables(positions), "sliding": self.local_rope.tables(positions)}
        for i, (layer_spec, (k_cache, v_cache)) in enumerate(zip(self.spec.layers, kv_caches, strict=True)):
            pre, post = self._pre[i], self._post[i]
            if lora is not None:
                pre, post = lora.pre_attention(i, pre), lora.post_attention(i, post)
            input_norm, post_attn, pre_mlp, post_mlp, q_norm, k_norm = self._norms[i]
            qkv = linear(_one_plus_norm(h, input_norm, eps), pre.qkv, pre.qkv_bias)
            q, k, v = qkv.split([shape.q_size, shape.kv_size, shape.kv_size], dim=-1)
            q = _one_plus_norm(q.reshape(-1, shape.num_heads, shape.head_dim), q_norm, eps)
            k = _one_plus_norm(k.reshape(-1, shape.num_kv_heads, shape.head_dim), k_norm, eps)
            cos, sin = tables[layer_spec.attention.kind]
            q, k, v = rotate(q, cos, sin), rotate(k, cos, sin), v.reshape(-1, shape.num_kv_heads, shape.head_dim)
            if layer_spec.attention.window is not None:
                attn = self._windowed.forward(q, k, v.contiguous(), k_cache, v_cache, meta, self.scale,
                                              window=layer_spec.attention.window)
            else:
                attn = self.attention.forward(q, k, v.contiguous(), k_cache, v_cache, meta, self.scale)
            h = h + _one_plus_norm(linear(attn.reshape(-1, shape.q_size), post.o_proj), post_attn, eps)
            gate, up = linear(_one_plus_norm(h, pre_mlp, eps), post.gate_up).chunk(2, dim=-1)  # type: ignore[arg-type]
            h = h + _one_plus_norm(linear(gelu_tanh(gate) * up, post.down), post_mlp, eps)  # type: ignore[arg-type]
        if reads is not None:
            h = h.index_select(0, reads.index)
        return _one_plus_norm(h, self._final_norm, eps)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._lm_head_proj is None:
            raise RuntimeError("this checkpoint has no language-model head")
        return self._softcap(self._lm_head_proj(hidden)).float()

    @torch.inference_mode()
    def greedy_token_ids(self, hidden: torch.Tensor, vocab_limit: int | None) -> torch.Tensor | None:
        # tanh can round two close logits to one value: the argmax is taken over the capped logits
        return None if self.config.final_logit_softcap is not None else super().greedy_token_ids(hidden, vocab_limit)

    @torch.inference_mode()
    def compute_label_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return self._softcap(super().compute_label_logits(hidden, token_ids).to(hidden.dtype)).float()


ARCHITECTURES = tuple(
    (Architecture(name, "gemma3", _config, Gemma3ForCausalLM, gguf=("gemma3",) if name == "Gemma3ForCausalLM" else ()),
     types)
    for name, types in (("Gemma3ForCausalLM", ("gemma3_text",)), ("Gemma3ForConditionalGeneration", ("gemma3",)),
                        ("Gemma3TextForSequenceClassification", ()), ("Gemma3ForSequenceClassification", ()))
)
