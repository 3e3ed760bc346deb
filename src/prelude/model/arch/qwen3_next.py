"""Qwen3-Next: the Qwen3.5 hybrid trunk (Gated DeltaNet and gated full-attention layers,
model/arch/qwen3_5.py) whose MLPs are mixtures of experts with a gated shared expert
(model/layers/moe.py) on every `decoder_sparse_step`-th layer outside `mlp_only_layers`.

Its DeltaNet projections are stored grouped by key head (each group's q, k, v and z rows
together in `in_proj_qkvz`, its b and a rows in `in_proj_ba`); they are reordered at load
into the q, k, v, z and b, a blocks the shared layer reads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from prelude.model.arch.qwen3_5 import HybridConfig, HybridDecoder, hybrid_config
from prelude.model.arch.qwen3_moe import MOE_FIELDS, expert_layers, moe_spec
from prelude.model.base import Architecture
from prelude.model.decoder import CastWeights
from prelude.model.layers.gated_delta_net import GatedDeltaNet
from prelude.model.layers.linear import Projection
from prelude.model.layers.moe import SparseMoe
from prelude.model.spec import MlpSpec

_HANDLED = MOE_FIELDS + ("shared_expert_intermediate_size",)


def grouped_to_blocks(weight: torch.Tensor, groups: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """Rows stored as `groups` groups of parts of `sizes` -> each part's rows of every group
    together, part after part."""
    parts = weight.reshape(groups, sum(sizes), -1).split(list(sizes), dim=1)
    return torch.cat([p.reshape(-1, weight.shape[-1]) for p in parts])


class Qwen3NextForCausalLM(HybridDecoder):
    def mlp_spec(self, config: HybridConfig, layer: int) -> MlpSpec:
        if self._moe is None or layer not in self._expert_layers:
            return super().mlp_spec(config, layer)
        return MlpSpec("moe", "silu", config.moe_intermediate_size, self._moe)

    def __init__(self, config: HybridConfig, *args: Any, **kwargs: Any) -> None:
        raw = {"num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
               "norm_topk_prob": config.norm_topk_prob, "decoder_sparse_step": config.decoder_sparse_step,
               "mlp_only_layers": config.mlp_only_layers, "num_hidden_layers": config.num_hidden_layers}
        self._expert_layers = expert_layers(raw)
        self._moe = moe_spec(config.architecture, raw, config.shared_expert_intermediate_size) \
            if self._expert_layers else None
        super().__init__(config, *args, **kwargs)

    def mlp(self, cast: CastWeights, prefix: str, prepack: bool) -> Any:
        layer = int(prefix.split(".")[-2])
        if self._moe is None or layer not in self._expert_layers:
            return super().mlp(cast, prefix, prepack)
        return SparseMoe.from_checkpoint(cast, prefix + "mlp.", self._moe, F.silu)

    def delta_net(self, cast: CastWeights, prefix: str, prepack: bool) -> GatedDeltaNet:
        p = prefix + "linear_attn."
        s = self.config.delta_shape
        r = s.num_v_heads // s.num_k_heads
        qkvz = grouped_to_blocks(cast[p + "in_proj_qkvz.weight"], s.num_k_heads,
                                 (s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim))
        ba = grouped_to_blocks(cast[p + "in_proj_ba.weight"], s.num_k_heads, (r, r))
        in_proj = Projection(torch.cat([qkvz, ba]), None, prepack)
        return GatedDeltaNet(s, in_proj, cast[p + "conv1d.weight"], cast[p + "dt_bias"], cast[p + "A_log"],
                             cast[p + "norm.weight"], Projection(cast[p + "out_proj.weight"], None, prepack))


def _config(raw: dict[str, Any], model_dir: Path | None = None) -> HybridConfig:
    name = str((raw.get("architectures") or ["Qwen3NextForCausalLM"])[0])
    config = hybrid_config(name, raw, handled=_HANDLED)
    return replace(config, num_experts=int(raw.get("num_experts") or 0),
                   num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
                   moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                   shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0))


ARCHITECTURES = tuple(
    (Architecture(name, "qwen3_next", _config, Qwen3NextForCausalLM,
                  gguf=("qwen3next",) if name == "Qwen3NextForCausalLM" else ()), types)
    for name, types in (("Qwen3NextForCausalLM", ("qwen3_next",)), ("Qwen3NextForSequenceClassification", ()))
)
