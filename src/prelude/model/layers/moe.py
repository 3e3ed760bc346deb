"""A sparse mixture-of-experts MLP (Qwen3-MoE; with a gated shared expert, Qwen3-Next and
Qwen3.5-MoE): a router scores every expert for each token, the `top_k` best run on it and
their outputs are summed with the router's weights.

The numbers follow transformers' Qwen3-MoE block: router logits in the model's dtype, the
softmax, top-k (torch.topk: its order decides ties) and renormalization in float32, the
weights cast back to the model's dtype; each expert a gated MLP; each token's outputs added
in ascending expert order into zeros (the torch path gives transformers' float32 bits; the
kernels round where it rounds, their GEMM sums in an order of their own).

Where the experts run:
- on the CPU, moe_experts.c (kernels/cpu/moe_experts.py) over a packed copy of the experts
  (it replaces the checkpoint's tensors: the experts are held once): one C call a step
  sorts the tokens by expert and runs each chosen expert's gated MLP over its tokens, one
  pass over its weights; a decode step reads top_k experts a token and nothing else. A
  token's sums there never depend on the other tokens of the step (each row in k order in
  its own registers), so the grouped call is batch-invariant as it is;
- on CUDA, the fused Triton kernel (kernels/triton/fused_moe.py): the tokens sorted by
  expert into blocks, one launch for gate/up with SiLU(gate) * up, one for down;
- elsewhere (no kernel for the dtype or device, or `own_kernels=False`), torch: the tokens
  sorted by expert, one F.linear an expert over its tokens (gate and up fused, then down),
  each expert's rows padded to a power of two so oneDNN's per-shape kernels stay few;
- a GGUF's experts kept in their quantized blocks (`read_blocks`): steps of few enough
  tokens read the blocks, expert by expert (fewer bytes than any float copy); longer steps
  take one of the ways above.

Batch invariance (`make_batch_invariant`): each token alone through the router and the
shared expert (one-row GEMMs: a GEMM's bits for a row can depend on how many rows it runs
with, as BLAS picks its kernel and blocking by row count), and through its experts by the
CPU kernel over all the step's tokens (per row already), else (the torch path, or a GGUF's
blocks) alone as well.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from prelude.kernels.cpu.moe_experts import MoeExperts, PackedExperts, load_moe_experts
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
    rows); down [E, hidden, I]. `own_kernels`: run the experts on moe_experts.c (CPU) or the
    fused Triton kernel (CUDA) where they serve (the module docstring); on the CPU the packed
    copy then replaces gate_up and down (None)."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                 norm_topk_prob: bool, activation: Activation, shared: SharedExpert | None = None,
                 own_kernels: bool = True) -> None:
        num_experts = router.shape[0]
        if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
            raise ValueError(f"{num_experts} router rows for {gate_up.shape[0]} / {down.shape[0]} experts")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} of {num_experts} experts")
        self.router = router
        self.gate_up: torch.Tensor | None = gate_up
        self.down: torch.Tensor | None = down
        self.top_k, self.norm_topk_prob, self.activation, self.shared = top_k, norm_topk_prob, activation, shared
        self.hidden, self.intermediate = int(down.shape[1]), int(down.shape[2])
        self.per_row = False  # make_batch_invariant
        self.expert_blocks: ExpertBlocks | None = None  # read_blocks
        self._cpu: MoeExperts | None = None
        self._packed: PackedExperts | None = None
        self._triton = False
        if own_kernels and activation is F.silu:  # the kernels' one activation (every MoE checkpoint's)
            if gate_up.device.type == "cpu":
                kernel = load_moe_experts()
                if kernel is not None and kernel.takes(gate_up.dtype):
                    self._cpu, self._packed = kernel, kernel.pack(gate_up, down)
                    self.gate_up = self.down = None  # held once: the packed copy
            elif gate_up.device.type == "cuda":
                self._triton = triton_moe_available()

    @property
    def num_experts(self) -> int:
        return int(self.router.shape[0])

    @property
    def packed(self) -> PackedExperts | None:
        """The CPU kernel's copy of the experts, where it runs them."""
        return self._packed

    @property
    def path(self) -> str:
        """Which way the experts run: "cpu_kernel", "triton" or "torch"."""
        return "cpu_kernel" if self._cpu is not None else "triton" if self._triton else "torch"

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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.shape[0]:
            return x.clone()
        if not self.per_row:
            weights, experts = self.route(x)
            out = self.run_experts(x, weights, experts)
            return out if self.shared is None else out + self.shared(x)
        if self._cpu is None or self.expert_blocks is not None:
            # the router's, the experts' and the shared expert's GEMMs one row at a time (a
            # GGUF's blocks serve one row, the kernel a step's rows: one way for every row)
            return torch.cat([self._alone(x[t:t + 1]) for t in range(x.shape[0])])
        # the CPU kernel gives each row its own bits whatever shares the call: one call for all
        routed = [self.route(x[t:t + 1]) for t in range(x.shape[0])]
        out = self.run_experts(x, torch.cat([w for w, _ in routed]), torch.cat([e for _, e in routed]))
        if self.shared is None:
            return out
        return out + torch.cat([self.shared(x[t:t + 1]) for t in range(x.shape[0])])

    def _alone(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = self.run_experts(x, weights, experts)
        return out if self.shared is None else out + self.shared(x)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The chosen experts' outputs summed with their weights: x [T, hidden], weights and
        experts [T, k] (route's) -> [T, hidden]."""
        if self.expert_blocks is not None and self.expert_blocks.takes(x):
            return self._grouped(x, weights, experts)  # every expert's rows few enough for the blocks
        if self._cpu is not None and self._packed is not None:
            return self._cpu.forward(x if x.stride(-1) == 1 else x.contiguous(), weights, experts, self._packed)
        assert self.gate_up is not None and self.down is not None
        if self._triton:
            from prelude.kernels.triton.fused_moe import fused_moe

            return fused_moe(x, self.gate_up, self.down, weights, experts)
        return self._grouped(x, weights, experts)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        blocks = self.expert_blocks
        if blocks is not None and blocks.takes(x):
            gate_up, down = blocks.experts[e]
            gate, up = blocks.kernel.linear(x, gate_up).chunk(2, dim=-1)
            return blocks.kernel.linear(self.activation(gate) * up, down)
        assert self.gate_up is not None and self.down is not None
        gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(self.activation(gate) * up, self.down[e])

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        k = self.top_k
        flat = experts.reshape(-1)
        # stable: each expert's tokens in ascending order; experts ascending, so every token
        # sums its experts' outputs in expert order
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, slots = order // k, order % k
        # oneDNN (a CPU's GEMMs outside float32) makes and caches a kernel per row count:
        # each expert's rows padded to a power of two keep those few (zero rows, dropped)
        pad = (x.device.type == "cpu" and x.dtype != torch.float32
               and not (self.expert_blocks is not None and self.expert_blocks.takes(x)))
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows, slot = tokens[start:start + n], slots[start:start + n]
            start += n
            xs = x.index_select(0, rows)
            if pad and n & (n - 1):
                xs = F.pad(xs, (0, 0, 0, (1 << n.bit_length()) - n))
            y = self._expert(e, xs)[:n] * weights[rows, slot].unsqueeze(-1)
            out.index_add_(0, rows, y)
        return out


def triton_moe_available() -> bool:
    """Whether the fused Triton kernel can run (triton imports)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def describe(layers: Mapping[int, SparseMoe], dtype: torch.dtype) -> str:
    """The start-up line: which layers hold experts and how a step runs them."""
    if not layers:
        return "no mixture-of-experts layers"
    first = next(iter(layers.values()))
    ways = {"cpu_kernel": "moe_experts.c over a packed copy, tokens grouped by expert, one pass over each "
                          "chosen expert's weights",
            "triton": "the fused Triton kernel, tokens sorted by expert into blocks",
            "torch": "tokens grouped by expert, one GEMM an expert over the tokens that chose it (torch F.linear)"}
    how = ways[first.path] + "; a step reads only the chosen experts' weights"
    if first.per_row:
        how += (" (batch-invariant: router and shared expert one row at a time" +
                (", the kernel per row already)" if first.path == "cpu_kernel" and first.expert_blocks is None
                 else ", the experts too)"))
    shared = ", a gated shared expert" if first.shared is not None else ""
    if first.expert_blocks is not None:
        how += (f"; steps of up to {first.expert_blocks.max_rows} tokens read the experts' GGUF "
                f"{first.expert_blocks.kind} blocks")
    return (f"mixture of experts on {len(layers)} layers: {first.num_experts} experts, top-{first.top_k}{shared}, "
            f"{str(dtype).removeprefix('torch.')}: {how}")
