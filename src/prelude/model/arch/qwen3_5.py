"""Qwen3.5: a hybrid decoder where Gated DeltaNet layers (linear attention with a
recurrent state) alternate with gated full-attention layers (a sigmoid output gate,
partial rotary, (1 + w) norms), each followed by a dense SiLU MLP; (1 + w) RMSNorms
throughout. The text model inside Qwen3_5ForConditionalGeneration checkpoints is served
alone (the vision tower is left out, said in the start-up log).

The trunk (HybridDecoder) is shared with Qwen3-Next, which swaps the MLP for experts.
Full-attention layers keep K/V in the paged blocks; linear layers keep their state in the
state pool's slots (model/attention/metadata.py StateRows says which row uses which).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from prelude.config import ModelConfig, Populate
from prelude.model.arch import hf_config
from prelude.model.attention import AttentionBackend, get_attention_backend
from prelude.model.attention.kv_memory import zeroed_kv_tensors
from prelude.model.attention.metadata import AttentionMetadata, StateRow, StateRows
from prelude.model.base import Architecture, DerivedTensors, KVCaches, NothingKept, UnsupportedCheckpoint
from prelude.model.decoder import CastWeights, DecoderHeads
from prelude.model.layers.decoder_segments import ACTIVATIONS
from prelude.model.layers.gated_attention import GatedAttention, GatedAttentionShape, rms_norm_one_plus
from prelude.model.layers.gated_delta_net import DeltaNetShape, GatedDeltaNet, Linear, RowPlan, plan_rows
from prelude.model.layers.linear import Projection, prepack_enabled
from prelude.model.layers.rotary import RotaryEmbedding
from prelude.model.lora.adapters import LoraStep
from prelude.model.lora.layout import LoraLayout, LoraProjection, LoraTarget, attention_projections, mlp_projections
from prelude.model.spec import AttentionSpec, DecoderSpec, LayerSpec, MlpSpec, RopeSpec

logger = logging.getLogger("prelude.model.qwen3_5")

_FULL, _LINEAR = "full_attention", "linear_attention"


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """ModelConfig plus what a hybrid decoder's layers need."""

    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Where the checkpoint keeps the text model's tensors ("model." or "model.language_model.")
    weight_prefix: str = "model."
    # Qwen3-Next's experts (0: a dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def delta_shape(self) -> DeltaNetShape:
        return DeltaNetShape(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                             self.linear_value_head_dim, self.linear_conv_kernel_dim, self.rms_norm_eps)


# Config fields every hybrid architecture here computes
HYBRID_FIELDS = ("layer_types", "full_attention_interval", "partial_rotary_factor", "linear_num_value_heads",
                 "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                 "attn_output_gate")


def text_part(raw: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The text model's config of a checkpoint (a *ForConditionalGeneration's text_config,
    with the top level's tie and token ids), and whether it was nested."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw, False
    merged = dict(text)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "architectures"):
        if key in raw:
            merged[key] = raw[key]
    return merged, True


def hybrid_config(name: str, raw: dict[str, Any], handled: tuple[str, ...] = ()) -> HybridConfig:
    """The HybridConfig of a Qwen3.5-shaped `raw` (the text part); refused in one line where
    it sets what the layers do not compute."""
    text, nested = text_part(raw)
    hf_config.refuse_unhandled(name, text, HYBRID_FIELDS + handled)
    hf_config.require(name, text, "hidden_act", ("silu",), "silu")
    hf_config.require(name, text, "attn_output_gate", (True,), True)
    theta, scaling = hf_config.rope_of(name, text)
    params = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    partial = float(text.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25)))
    base = ModelConfig.from_hf_dict({**text, "sliding_window": None})
    layers = base.num_hidden_layers
    types = text.get("layer_types")
    if not types:
        interval = int(text.get("full_attention_interval", 4))
        types = [_LINEAR if (i + 1) % interval else _FULL for i in range(layers)]
    if len(types) != layers or any(t not in (_FULL, _LINEAR) for t in types):
        raise UnsupportedCheckpoint(f"architecture {name}: layer_types {hf_config._short(types)} is not supported "
                                    f"(supported: {_FULL}, {_LINEAR}, one per layer)")
    fields = {f: int(text[f]) for f in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                        "linear_value_head_dim", "linear_conv_kernel_dim") if text.get(f)}
    config = HybridConfig(**{**vars(base), "architecture": name, "rope_theta": theta, "rope_scaling": scaling},
                          layer_types=tuple(types), partial_rotary_factor=partial,
                          weight_prefix="model.language_model." if nested else "model.", **fields)
    if config.linear_num_value_heads % max(1, config.linear_num_key_heads):
        raise UnsupportedCheckpoint(f"architecture {name}: {config.linear_num_value_heads} linear value heads do not "
                                    f"group over {config.linear_num_key_heads} key heads")
    if config.rotary_dim % 2 or config.rotary_dim <= 0:
        raise UnsupportedCheckpoint(f"architecture {name}: partial_rotary_factor {partial} gives an odd rotary width")
    return config


def describe(config: HybridConfig, mlps: Sequence[MlpSpec]) -> DecoderSpec:
    rope = RopeSpec(config.rope_theta, config.rope_scaling, config.rotary_dim)
    full = AttentionSpec("full", config.num_attention_heads, config.num_key_value_heads, config.head_dim, rope,
                         config.head_dim**-0.5, qk_norm=True, output_gate=True)
    linear = AttentionSpec("linear", config.linear_num_value_heads, config.linear_num_key_heads,
                           config.linear_value_head_dim, None, config.linear_key_head_dim**-0.5)
    layers = tuple(LayerSpec(full if t == _FULL else linear, mlp, "rms_one_plus", config.rms_norm_eps)
                   for t, mlp in zip(config.layer_types, mlps, strict=True))
    return DecoderSpec(config.architecture, config.hidden_size, config.vocab_size, layers, "rms_one_plus",
                       tie_word_embeddings=config.tie_word_embeddings)


class TextWeights(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors under the names a text-only model reads (`model.*`, `lm_head`,
    `score`): a *ForConditionalGeneration's `model.language_model.*` renamed, its vision
    tower and the multi-token-prediction head (a draft model for speculative decoding,
    which no answer reads) left out, said once in the log."""

    def __init__(self, source: Mapping[str, torch.Tensor], prefix: str) -> None:
        self._source = source
        self._names: dict[str, str] = {}
        skipped: dict[str, int] = {}
        for name in source:
            if name.startswith(("model.visual.", "visual.", "mtp.", "model.mtp.")):
                part = name.split(".")[1] if name.startswith("model.") else name.split(".")[0]
                skipped[part] = skipped.get(part, 0) + 1
                continue
            own = "model." + name[len(prefix):] if name.startswith(prefix) else name
            self._names[own] = name
        for part, n in sorted(skipped.items()):
            what = "the vision tower" if part == "visual" else "the multi-token-prediction head"
            logger.info("%s (%d tensors) left out: the engine serves the text model", what, n)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._source[self._names[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class DenseMlp:
    def __init__(self, gate_up: Linear, down: Linear, activation: str = "silu") -> None:
        self.gate_up, self.down, self.act = gate_up, down, ACTIVATIONS[activation]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class HybridLayer:
    def __init__(self, mixer: GatedAttention | GatedDeltaNet, mlp: Any, input_norm: torch.Tensor,
                 post_norm: torch.Tensor) -> None:
        self.mixer, self.mlp, self.input_norm, self.post_norm = mixer, mlp, input_norm, post_norm


class HybridDecoder(DecoderHeads):
    """Inference-only hybrid decoder over the shared layers. kv_caches holds, per layer,
    (K blocks, V blocks) for a full-attention layer and (conv states, recurrent states) of
    the state pool's slots for a linear one."""

    is_encoder = False
    default_pooling = "last"
    computes_read_positions = False
    weights_are_plain = False

    def __init__(self, config: HybridConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", attention: AttentionBackend | None = None,
                 max_positions: int | None = None, prepack: bool = True, blocks: Any = None,
                 prepared: DerivedTensors | None = None) -> None:
        if blocks:
            raise UnsupportedCheckpoint(f"architecture {config.architecture}: GGUF block-format weights are not "
                                        "served for hybrid models yet")
        self.config = config
        self.spec = describe(config, [self.mlp_spec(config, i) for i in range(config.num_hidden_layers)])
        self.dtype = dtype
        self.device = torch.device(device)
        prepack = prepack and prepack_enabled(dtype, self.device)
        cast = CastWeights(TextWeights(weights, config.weight_prefix), dtype, self.device,  # type: ignore[arg-type]
                           prepared if prepared is not None else NothingKept())
        self._cast = cast
        self.embed = cast["model.embed_tokens.weight"]
        self.attn_shape = GatedAttentionShape(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                              config.rms_norm_eps)
        self.layers = [self._layer(cast, f"model.layers.{i}.", kind, prepack)
                       for i, kind in enumerate(config.layer_types)]
        self.norm = cast["model.norm.weight"]
        self.score = cast.get("score.weight")
        if "lm_head.weight" in cast:
            self.lm_head: torch.Tensor | None = cast["lm_head.weight"]
        else:
            self.lm_head = self.embed if config.tie_word_embeddings or self.score is None else None
        self._lm_head_proj = Projection(self.lm_head, None, prepack, head=True) if self.lm_head is not None else None
        self.attention = attention or get_attention_backend("torch")
        self.rope = RotaryEmbedding(replace(config, head_dim=config.rotary_dim),
                                    max_positions or config.max_position_embeddings, dtype, self.device)
        cast.check_all_read(config.architecture)
        self.full_layers = [i for i, t in enumerate(config.layer_types) if t == _FULL]
        self.linear_layers = [i for i, t in enumerate(config.layer_types) if t == _LINEAR]

    # --- building --------------------------------------------------------------------

    def mlp_spec(self, config: HybridConfig, layer: int) -> MlpSpec:
        """Layer `layer`'s MLP (Qwen3-Next: experts on some layers)."""
        return MlpSpec("dense", "silu", config.intermediate_size)

    def mlp(self, cast: CastWeights, prefix: str, prepack: bool) -> Any:
        """The layer's MLP (Qwen3-Next: its experts)."""
        return DenseMlp(Projection(cast.stacked([prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]),
                                   None, prepack),
                        Projection(cast[prefix + "mlp.down_proj.weight"], None, prepack))

    def delta_net(self, cast: CastWeights, prefix: str, prepack: bool) -> GatedDeltaNet:
        p = prefix + "linear_attn."
        in_proj = Projection(cast.stacked([p + "in_proj_qkv.weight", p + "in_proj_z.weight", p + "in_proj_b.weight",
                                           p + "in_proj_a.weight"]), None, prepack)
        return GatedDeltaNet(self.config.delta_shape, in_proj, cast[p + "conv1d.weight"], cast[p + "dt_bias"],
                             cast[p + "A_log"], cast[p + "norm.weight"],
                             Projection(cast[p + "out_proj.weight"], None, prepack))

    def _layer(self, cast: CastWeights, prefix: str, kind: str, prepack: bool) -> HybridLayer:
        if kind == _LINEAR:
            mixer: GatedAttention | GatedDeltaNet = self.delta_net(cast, prefix, prepack)
        else:
            a = prefix + "self_attn."
            qkv = Projection(cast.stacked([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]), None,
                             prepack)
            mixer = GatedAttention(self.attn_shape, qkv, cast[a + "q_norm.weight"], cast[a + "k_norm.weight"],
                                   Projection(cast[a + "o_proj.weight"], None, prepack))
        return HybridLayer(mixer, self.mlp(cast, prefix, prepack), cast[prefix + "input_layernorm.weight"],
                           cast[prefix + "post_attention_layernorm.weight"])

    # --- LoRA ------------------------------------------------------------------------

    def lora_layout(self) -> LoraLayout:
        """The projections adapters may target (PEFT's names in transformers' modules): the
        gated attention's q/k/v/o (q_proj holds the query and its gate), the linear
        layers' input and output projections, and the MLP's."""
        c = self.config
        q = c.num_attention_heads * c.head_dim
        full = attention_projections(c.hidden_size, 2 * q, c.num_key_value_heads * c.head_dim, q)
        layers = []
        for i, kind in enumerate(c.layer_types):
            mixer = full if kind == _FULL else self.delta_projections()
            layers.append(mixer + self.mlp_projections(i))
        return LoraLayout(c.hidden_size, tuple(layers), self.expert_layers())

    def delta_projections(self) -> tuple[LoraProjection, ...]:
        """A linear layer's: in_proj_qkv/z/b/a (fused in that order) and out_proj."""
        s, h = self.config.delta_shape, self.config.hidden_size
        p = "linear_attn."
        return (LoraProjection("in_proj", h, (LoraTarget("in_proj_qkv", p + "in_proj_qkv", s.conv_channels),
                                              LoraTarget("in_proj_z", p + "in_proj_z", s.value_size),
                                              LoraTarget("in_proj_b", p + "in_proj_b", s.num_v_heads),
                                              LoraTarget("in_proj_a", p + "in_proj_a", s.num_v_heads))),
                LoraProjection("out_proj", s.value_size, (LoraTarget("out_proj", p + "out_proj", h),)))

    def mlp_projections(self, layer: int) -> tuple[LoraProjection, ...]:
        return mlp_projections(self.config.hidden_size, self.config.intermediate_size)

    def expert_layers(self) -> tuple[int, ...]:
        return ()

    def _adapted(self, index: int, layer: HybridLayer, lora: LoraStep) -> HybridLayer:
        """`layer` with the adapters' deltas in its projections (shallow copies: the
        weights stay shared)."""
        mixer = copy.copy(layer.mixer)
        if isinstance(mixer, GatedDeltaNet):
            mixer.in_proj = lora.linear(index, "in_proj", mixer.in_proj)
            mixer.out_proj = lora.linear(index, "out_proj", mixer.out_proj)
        else:
            mixer.qkv = lora.linear(index, "qkv", mixer.qkv)
            mixer.o_proj = lora.linear(index, "o_proj", mixer.o_proj)
        return HybridLayer(mixer, self.adapted_mlp(index, layer.mlp, lora), layer.input_norm, layer.post_norm)

    def adapted_mlp(self, index: int, mlp: Any, lora: LoraStep) -> Any:
        adapted = copy.copy(mlp)
        adapted.gate_up = lora.linear(index, "gate_up", mlp.gate_up)
        adapted.down = lora.linear(index, "down", mlp.down)
        return adapted

    # --- the forward -----------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: KVCaches,
                token_type_ids: torch.Tensor | None = None, lora: LoraStep | None = None,
                **_: Any) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden]. Linear layers
        run the rows of `meta.states`; without it (a forward on scratch), every row is a
        fresh prompt on a dropped state. `lora`: the resident adapters and each token's slot."""
        layers = self.layers if lora is None else [self._adapted(i, layer, lora) for i, layer in enumerate(self.layers)]
        states = meta.states if meta.states is not None else _scratch_rows(meta)
        eps = self.config.rms_norm_eps
        h = self.embed.index_select(0, input_ids)
        cos, sin = self.rope.tables(positions)
        plan: RowPlan | None = None  # the linear layers' row table, built by the first of them
        for layer, (first, second) in zip(layers, kv_caches, strict=True):
            x = rms_norm_one_plus(h, layer.input_norm, eps)
            if isinstance(layer.mixer, GatedDeltaNet):
                conv, rec = (first, second) if first.numel() else (None, None)
                if plan is None and layer.mixer.uses_plan(x):
                    plan = plan_rows(states, layer.mixer.shape, x.dtype, conv is not None, x.device)
                h = h + layer.mixer.forward(x, states, conv, rec, plan)
            else:
                h = h + layer.mixer.forward(x, cos, sin, self.attention, first, second, meta)
            h = h + layer.mlp(rms_norm_one_plus(h, layer.post_norm, eps))
        return rms_norm_one_plus(h, self.norm, eps)

    # --- heads -----------------------------------------------------------------------

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_limit: int | None) -> torch.Tensor | None:
        return None

    def make_packed_copies(self) -> int:
        return 0

    # --- memory ----------------------------------------------------------------------

    def state_bytes_per_slot(self) -> int:
        """One sequence's recurrent state over every linear layer."""
        return len(self.linear_layers) * self.config.delta_shape.bytes_per_slot(self.dtype)

    def kv_bytes_per_block(self, block_size: int) -> int:
        per_token = 2 * self.config.num_key_value_heads * self.config.head_dim * self.dtype.itemsize
        return per_token * block_size * len(self.full_layers)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, populate: Populate = "off",
                          state_slots: int = 0) -> KVCaches:
        """K/V blocks for the full layers, `state_slots` slots of state for the linear ones."""
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        kv = zeroed_kv_tensors(2 * len(self.full_layers), shape, self.dtype, self.device, populate)
        conv, rec = self.config.delta_shape.state_shapes()
        caches: KVCaches = []
        at = 0
        for kind in self.config.layer_types:
            if kind == _FULL:
                caches.append((kv[at], kv[at + 1]))
                at += 2
            else:
                caches.append((torch.zeros((state_slots, *conv), dtype=self.dtype, device=self.device),
                               torch.zeros((state_slots, *rec), dtype=torch.float32, device=self.device)))
        return caches


def _scratch_rows(meta: AttentionMetadata) -> StateRows:
    if meta.decodes is not None:
        raise ValueError("decode rows of a model with recurrent layers need their state slots (meta.states)")
    return StateRows(tuple(StateRow(p.query_start, p.query_len, -1, True) for p in meta.prefills))


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> HybridConfig:
    name = str((raw.get("architectures") or ["Qwen3_5ForCausalLM"])[0])
    if raw.get("text_config") is not None and raw.get("vision_config") is not None:
        logger.info("%s: the text model is served; image and video inputs are refused", name)
    return hybrid_config(name, raw)


class Qwen3_5ForCausalLM(HybridDecoder):
    pass


ARCHITECTURES = tuple(
    (Architecture(name, "qwen3_5", _config, Qwen3_5ForCausalLM, gguf=("qwen35",) if name == "Qwen3_5ForCausalLM" else ()),
     types)
    for name, types in (("Qwen3_5ForCausalLM", ("qwen3_5_text",)), ("Qwen3_5ForConditionalGeneration", ("qwen3_5",)),
                        ("Qwen3_5ForSequenceClassification", ()), ("Qwen3_5TextForSequenceClassification", ()))
)
