"""A sparse mixture-of-experts MLP (Qwen3-MoE; with a gated shared expert, Qwen3-Next and
Qwen3.5-MoE): a router scores every expert for each token, the `top_k` best run on it and
their outputs are summed with the router's weights.

The numbers follow transformers' Qwen3-MoE block: router logits in the model's dtype, the
softmax, top-k (torch.topk: its order decides ties) and renormalization in float32, the
weights cast back to the model's dtype; each expert a gated MLP; each token's outputs added
in ascending expert order into zeros, so a float32 forward gives the same bits.

Two ways through the experts:
- grouped (the default): the tokens sorted by the expert they chose, one GEMM an expert
  over its tokens (gate and up fused, then down). Only the chosen experts' weights are
  read, so a decode step reads top_k experts a token, not all of them;
- per row (`make_batch_invariant`): each token alone through the router, its own experts
  and the shared expert, one-row GEMMs. A GEMM's bits for a row can depend on how many rows it runs with (BLAS picks
  its kernel and blocking by row count), so the grouped way makes a token's result depend
  on which other tokens chose the same expert in that step; one-row GEMMs do not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from prelude.kernels.ggml_quants import GgmlQuants
from prelude.model.layers.linear import QuantPath
from prelude.model.spec import MoeSpec

Activation = Callable[[torch.Tensor], torch.Tensor]


class ExpertBlocks:
    """A GGUF's experts kept in their quantized blocks (kernels/ggml_quants.py): expert e's
    gate_up and down weights as views of the stacked blocks, read by the block kernel for
    calls of at most `max_rows` rows (a decode step's tokens an expert), which read a
    quarter to a seventh of float32's bytes. Larger calls take the float32/bf16 copy."""

    def __init__(self, gate_up: QuantPath, down: QuantPath, num_experts: int) -> None:
        self.kernel, self.max_rows = gate_up.kernel, min(gate_up.max_rows, down.max_rows)
        self.kind = gate_up.blocks.kind
        self.experts = [(_rows(gate_up.blocks, e, num_experts), _rows(down.blocks, e, num_experts))
                        for e in range(num_experts)]

    def takes(self, x: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= self.max_rows and self.kernel.takes(x.dtype)


def _rows(blocks: GgmlQuants, e: int, num_experts: int) -> GgmlQuants:
    n = blocks.out_features // num_experts
    part = lambda t: t[e * n:(e + 1) * n]  # noqa: E731 - contiguous rows: a view
    return GgmlQuants(blocks.kind, part(blocks.qs), part(blocks.d), None if blocks.m is None else part(blocks.m))


class WeightSource(Protocol):
    """Checkpoint tensors by name (model/decoder.py's CastWeights): single and stacked reads."""

    def __getitem__(self, name: str) -> torch.Tensor: ...

    def __contains__(self, name: object) -> bool: ...

    def stacked(self, names: Sequence[str]) -> torch.Tensor: ...


class SharedExpert:
    """A dense gated MLP every token runs, its output scaled by sigmoid(x . gate) where the
    checkpoint has a gate (`shared_expert_gate`)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None,
                 activation: Activation) -> None:
        self.gate_up, self.down, self.gate, self.activation = gate_up, down, gate, activation

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, self.gate_up).chunk(2, dim=-1)
        out = F.linear(self.activation(g) * u, self.down)
        return out if self.gate is None else torch.sigmoid(F.linear(x, self.gate)) * out


class SparseMoe:
    """router [E, hidden]; gate_up [E, 2 I, hidden] (each expert's gate rows, then its up
    rows); down [E, hidden, I]."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                 norm_topk_prob: bool, activation: Activation, shared: SharedExpert | None = None) -> None:
        num_experts = router.shape[0]
        if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
            raise ValueError(f"{num_experts} router rows for {gate_up.shape[0]} / {down.shape[0]} experts")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} of {num_experts} experts")
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.norm_topk_prob, self.activation, self.shared = top_k, norm_topk_prob, activation, shared
        self.per_row = False  # make_batch_invariant
        self.expert_blocks: ExpertBlocks | None = None  # read_blocks

    @property
    def num_experts(self) -> int:
        return int(self.router.shape[0])

    @staticmethod
    def from_checkpoint(weights: WeightSource, prefix: str, spec: MoeSpec, activation: Activation) -> "SparseMoe":
        """The block under `prefix` (`model.layers.3.mlp.`): `gate.weight`, the experts as
        `experts.{e}.{gate,up,down}_proj.weight` (or stacked `experts.gate_up_proj` and
        `experts.down_proj`), and where `spec` has one, `shared_expert.*` and
        `shared_expert_gate.weight`."""
        e = spec.num_experts
        router = weights[prefix + "gate.weight"]
        if prefix + "experts.gate_up_proj" in weights:
            gate_up, down = weights[prefix + "experts.gate_up_proj"], weights[prefix + "experts.down_proj"]
        else:
            x = prefix + "experts."
            gate_up = weights.stacked([f"{x}{i}.{n}_proj.weight" for i in range(e) for n in ("gate", "up")])
            down = weights.stacked([f"{x}{i}.down_proj.weight" for i in range(e)])
            gate_up = gate_up.view(e, -1, gate_up.shape[-1])
            down = down.view(e, -1, down.shape[-1])
        shared = None
        if spec.shared_intermediate_size:
            s = prefix + "shared_expert."
            shared = SharedExpert(weights.stacked([s + "gate_proj.weight", s + "up_proj.weight"]),
                                  weights[s + "down_proj.weight"],
                                  weights[prefix + "shared_expert_gate.weight"]
                                  if prefix + "shared_expert_gate.weight" in weights else None, activation)
        return SparseMoe(router, gate_up, down, spec.top_k, spec.norm_topk_prob, activation, shared)

    def read_blocks(self, gate_up: QuantPath, down: QuantPath) -> None:
        """Few-row expert calls read these GGUF blocks (rows: expert after expert, as
        gate_up and down stack them) from now on."""
        self.expert_blocks = ExpertBlocks(gate_up, down, self.num_experts)

    def make_batch_invariant(self) -> None:
        """Every token alone from now on (the module docstring says why)."""
        self.per_row = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, experts [T, k] int64)."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        blocks = self.expert_blocks
        if blocks is not None and blocks.takes(x):
            gate_up, down = blocks.experts[e]
            gate, up = blocks.kernel.linear(x, gate_up).chunk(2, dim=-1)
            return blocks.kernel.linear(self.activation(gate) * up, down)
        gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(self.activation(gate) * up, self.down[e])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_row:  # the router's and the shared expert's GEMMs one row at a time as well
            return torch.cat([self._block(x[t:t + 1]) for t in range(x.shape[0])]) if x.shape[0] else x.clone()
        return self._block(x)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = self._grouped(x, weights, experts)
        return out if self.shared is None else out + self.shared(x)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        k = self.top_k
        flat = experts.reshape(-1)
        # stable: each expert's tokens in ascending order; experts ascending, so every token
        # sums its experts' outputs in expert order
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, slots = order // k, order % k
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows, slot = tokens[start:start + n], slots[start:start + n]
            start += n
            y = self._expert(e, x.index_select(0, rows)) * weights[rows, slot].unsqueeze(-1)
            out.index_add_(0, rows, y)
        return out


def describe(layers: Mapping[int, SparseMoe], dtype: torch.dtype) -> str:
    """The start-up line: which layers hold experts and how a step runs them."""
    if not layers:
        return "no mixture-of-experts layers"
    first = next(iter(layers.values()))
    how = ("each token alone through its chosen experts, one-row GEMMs (batch-invariant)" if first.per_row else
           "tokens grouped by expert, one GEMM an expert over the tokens that chose it (torch F.linear); "
           "a step reads only the chosen experts' weights")
    shared = ", a gated shared expert" if first.shared is not None else ""
    if first.expert_blocks is not None:
        how += (f"; calls of up to {first.expert_blocks.max_rows} rows an expert read its GGUF "
                f"{first.expert_blocks.kind} blocks")
    return (f"mixture of experts on {len(layers)} layers: {first.num_experts} experts, top-{first.top_k}{shared}, "
            f"{str(dtype).removeprefix('torch.')}: {how}")
