"""Which projections of which layer LoRA adapters may target, and how Prelude holds them.

A layout lists, per layer, Prelude's projections that take a delta (`LoraProjection`: its
input size and the PEFT modules it holds side by side, in output order). Each module is
named as PEFT names it (`q_proj`, `in_proj_qkv`) and found by its path under the layer
(`self_attn.q_proj`, `linear_attn.in_proj_qkv`, `mlp.shared_expert.gate_proj`).

Dense trunks have the same projections on every layer (`dense_layout`); a hybrid model's
layers differ (attention or linear-attention projections, a dense MLP or a shared expert),
so the model gives its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prelude.config import ModelConfig


@dataclass(frozen=True)
class LoraTarget:
    """One PEFT module: its name, its path under a layer and its output size. `order`:
    where Prelude's projection reorders the module's output rows at load (row i holds the
    module's row order[i]); None when they are kept in order."""

    name: str
    path: str
    fan_out: int
    order: torch.Tensor | None = field(default=None, compare=False)


@dataclass(frozen=True)
class LoraProjection:
    """One of Prelude's projections (a fusion of `targets`, outputs side by side)."""

    name: str
    fan_in: int
    targets: tuple[LoraTarget, ...]

    @property
    def outs(self) -> list[int]:
        return [t.fan_out for t in self.targets]


@dataclass(frozen=True)
class LoraLayout:
    """Per layer, the projections adapters may target. `expert_layers`: layers whose MLP is
    a mixture of experts (refused targets, said so in the error)."""

    hidden_size: int
    layers: tuple[tuple[LoraProjection, ...], ...]
    expert_layers: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def target_names(self) -> tuple[str, ...]:
        """Every module name some layer holds, in first-seen order."""
        seen: dict[str, None] = {}
        for layer in self.layers:
            for proj in layer:
                for t in proj.targets:
                    seen.setdefault(t.name, None)
        return tuple(seen)

    def find(self, layer: int, path: str) -> tuple[LoraProjection, int] | None:
        """The projection holding the module at `path` of `layer`, and its place in it."""
        for proj in self.layers[layer]:
            for j, t in enumerate(proj.targets):
                if t.path == path:
                    return proj, j
        return None

    def place(self, layer: int, target: str) -> tuple[LoraProjection, int]:
        """The projection holding module `target` of `layer`, and its place in it."""
        for proj in self.layers[layer]:
            for j, t in enumerate(proj.targets):
                if t.name == target:
                    return proj, j
        raise KeyError(f"layer {layer} has no {target}")


def attention_projections(hidden: int, q_out: int, kv_out: int, o_in: int,
                          prefix: str = "self_attn.") -> tuple[LoraProjection, ...]:
    """q/k/v fused into `qkv`, and `o_proj`."""
    return (LoraProjection("qkv", hidden, (LoraTarget("q_proj", prefix + "q_proj", q_out),
                                           LoraTarget("k_proj", prefix + "k_proj", kv_out),
                                           LoraTarget("v_proj", prefix + "v_proj", kv_out))),
            LoraProjection("o_proj", o_in, (LoraTarget("o_proj", prefix + "o_proj", hidden),)))


def mlp_projections(hidden: int, intermediate: int, prefix: str = "mlp.") -> tuple[LoraProjection, ...]:
    """gate/up fused into `gate_up`, and `down`."""
    return (LoraProjection("gate_up", hidden, (LoraTarget("gate_proj", prefix + "gate_proj", intermediate),
                                               LoraTarget("up_proj", prefix + "up_proj", intermediate))),
            LoraProjection("down", intermediate, (LoraTarget("down_proj", prefix + "down_proj", hidden),)))


def dense_layout(config: ModelConfig) -> LoraLayout:
    """The dense trunk's: q/k/v/o on every layer, gate/up/down where the MLP is not experts."""
    h = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attention = attention_projections(h, q, kv, q)
    mlp = mlp_projections(h, config.intermediate_size)
    experts = set(config.expert_layers)
    return LoraLayout(h, tuple(attention if i in experts else attention + mlp for i in range(config.num_hidden_layers)),
                      tuple(sorted(experts)))


def layout_of(source: ModelConfig | LoraLayout) -> LoraLayout:
    return source if isinstance(source, LoraLayout) else dense_layout(source)
