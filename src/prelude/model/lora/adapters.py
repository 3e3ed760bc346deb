"""LoRA adapters beside one copy of the base weights: PEFT files in, stacked slots, and
the per-forward delta of every row's own adapter.

An adapter (PEFT's `adapter_config.json` + `adapter_model.safetensors`) adds
`scaling * B (A x)` to some of q/k/v/o/gate/up/down (a hybrid model's layers also to
their linear-attention projections: which projections of which layer, layout.py). Prelude
fuses q/k/v and gate/up into one projection each, so the delta of a fused projection is
the concatenation of its targets' deltas: its slot holds the targets' A side by side ([in, k R]) and their B as a
block diagonal ([k R, out]), so one shrink and one expand serve the fused projection.

Resident adapters sit in `LoraSlots`: for each layer and fused projection, A as
[slots, in, k R] and B as [slots, k R, out] (the scaling folded into B; ranks below
`max_rank` are zero-padded, which adds nothing); in bf16 on an AVX512-BF16 CPU only in the
C kernels' own layout instead (lora_cpu.StreamLayout, B's zero blocks left out). A forward gets a `LoraStep` (the slots
and this batch's per-token slot index, -1 for the base) as an explicit argument; it wraps
each projection operand so that the decoder's `linear(...)` call sites add the delta.
Without a LoraStep the forward is the plain one: no extra op.

On the CPU, these ways, never a loop over rows:
- few tokens (decode, <= DENSE_MAX_TOKENS): one call of a C kernel (kernels/cpu/lora_cpu.c)
  in which every token reads its own slot (on an AVX512-BF16 CPU from the StreamLayout
  slots: each token's A and B one sequential stream, faster than row-major slots);
  without it, every slot at once on oneDNN-prepacked copies: x @ A as [in, slots k R],
  masked to each token's own slot, then one expand-and-add with B viewed [slots k R, out]
  (three calls, faster than aten's unpacked bf16 matmuls, and far faster than one shrink
  and expand per adapter);
- more tokens (prefill), bf16 on an AVX512-BF16 CPU: one call of the grouped C kernel
  (lora_cpu.c's lora_sgmv): tokens grouped by slot, each slot's A and B's diagonal blocks
  repacked once per call into vdpbf16ps pairs, tiles of 8 tokens sharing them;
- otherwise (float32, or no AVX512-BF16): grouped by adapter, one shrink and one expand
  per distinct adapter over its rows (a view when contiguous, else an index).
The figures are in docs/benchmarks.md (`python -m benchmarks.lora`).
On CUDA a Triton kernel pair (kernels/triton/lora.py) reads the per-token slot index, so a
captured CUDA graph takes the index as an input like the token ids.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from prelude.config import ModelConfig
from prelude.model.layers.decoder_segments import PreAttention, Linear, PostAttention, linear
from prelude.model.lora.layout import LoraLayout, LoraProjection, layout_of
from prelude.model.layers.linear import bound_onednn_caches, prepack_enabled
from prelude.kernels.cpu.lora_cpu import CPU_KERNEL_DTYPES, SlotOperands, StreamLayout, load_lora_kernel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Prelude's fused projections and the PEFT targets they hold, in output order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# Sequence-classification heads a PEFT adapter may carry in `modules_to_save`.
HEAD_MODULES = ("score", "classifier")
DENSE_MAX_TOKENS = 32  # CPU forwards of at most this many tokens take the masked all-slots path
# A module's tensors: its layer, its path under the layer (`self_attn.q_proj`), A or B
_LORA_KEY = re.compile(r"layers\.(\d+)\.([\w.]+?)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served on this base (the server answers 400)."""


def _shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every target module."""
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights on the host, checked against the base config."""

    name: str
    path: Path
    rank: int  # the largest rank of its modules
    # (layer, target) -> (A [r, in], B scaled [out, r]), float32
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    head: torch.Tensor | None = None  # a modules_to_save classification head [labels, hidden]
    labels: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values()) + (
            self.head.nbytes if self.head is not None else 0)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise LoraError(f"adapter path {str(path)!r} is not a directory")
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (path / f).is_file()]
    if missing:
        raise LoraError(f"adapter {str(path)!r} lacks {', '.join(missing)} (PEFT's format)")
    try:
        with open(path / ADAPTER_CONFIG, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraError(f"cannot read {ADAPTER_CONFIG}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{ADAPTER_CONFIG} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("target_parameters"):  # PEFT's LoRA on bare parameters: a mixture of experts' stacked experts
        raise LoraError(f"adapters on parameters ({', '.join(map(str, cfg['target_parameters']))}: a "
                        "mixture-of-experts MLP's experts) are not supported; adapters on the attention "
                        "projections are")
    for unsupported in ("use_dora", "rank_pattern", "alpha_pattern"):
        if cfg.get(unsupported):
            raise LoraError(f"{unsupported} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError("adapters that train biases (bias != 'none') are not supported")
    return cfg


def read_adapter(name: str, path: str | Path, config: ModelConfig | LoraLayout, max_rank: int) -> LoraAdapter:
    """Load and check a PEFT LoRA adapter against the base (its config: the dense trunk's
    layout; or the model's own layout); LoraError says what does not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    layout = layout_of(config)
    supported = layout.target_names()
    path = Path(path).expanduser()
    cfg = _read_config(path)
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list):
        # a name or a path's tail (`shared_expert.gate_proj`), as PEFT matches them
        unknown = sorted(t for t in map(str, targets) if t.rsplit(".", 1)[-1] not in supported)
        if unknown:
            raise LoraError(f"unknown target module(s) {', '.join(unknown)}; supported: {', '.join(supported)}")
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise LoraError(f"cannot read {ADAPTER_WEIGHTS}: {e}") from None
    alpha = cfg.get("lora_alpha", cfg.get("r", 8))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise LoraError(f"lora_alpha must be a positive finite number, got {alpha!r}")
    rslora = bool(cfg.get("use_rslora", False))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    places: dict[tuple[int, str], tuple[LoraProjection, int]] = {}
    head = None
    for key, t in tensors.items():
        m = _LORA_KEY.search(key)
        if m is None and ".experts." in key:
            raise LoraError(f"tensor {key!r} adapts a mixture-of-experts MLP's experts, which is not supported "
                            f"(supported: {', '.join(supported)})")
        if m is None:
            module = key.split(".")[-2] if key.count(".") else key
            if module in HEAD_MODULES and key.endswith(".weight"):
                head = t.float()
                continue
            if module in HEAD_MODULES and key.endswith(".bias"):
                raise LoraError(f"a {module} head with a bias is not supported")
            raise LoraError(f"unknown tensor {key!r}: adapters may target {', '.join(supported)} only")
        layer, module_path, side = int(m.group(1)), m.group(2), m.group(3)
        if layer >= layout.num_layers:
            raise LoraError(f"tensor {key!r} is for layer {layer}; the base has {layout.num_layers}")
        found = layout.find(layer, module_path)
        if found is None:
            if ".experts." in f".{module_path}." or (layer in layout.expert_layers and module_path.startswith("mlp.")):
                raise LoraError(f"tensor {key!r}: layer {layer}'s MLP is a mixture-of-experts, whose experts adapters "
                                f"may not target (supported: {', '.join(supported)})")
            if module_path.rsplit(".", 1)[-1] in supported:
                raise LoraError(f"tensor {key!r}: layer {layer} has no module {module_path!r}")
            raise LoraError(f"unknown target module {module_path!r}; supported: {', '.join(supported)}")
        proj, j = found
        target = proj.targets[j].name
        places[(layer, target)] = found
        halves.setdefault((layer, target), {})[side] = t.float()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, target), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"layer {layer} {target} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        proj, j = places[(layer, target)]
        fan_in, fan_out, order = proj.fan_in, proj.targets[j].fan_out, proj.targets[j].order
        r = a.shape[0] if a.dim() == 2 else 0
        if r < 1 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise LoraError(f"layer {layer} {target}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                            f"the base's {fan_out}x{fan_in} projection")
        if r > max_rank:
            raise LoraError(f"rank {r} is over --max-lora-rank {max_rank}")
        scaling = alpha / (math.sqrt(r) if rslora else r)
        if order is not None:  # B's rows in the order the base's projection keeps them
            b = b.index_select(0, order)
        weights[(layer, target)] = (a.contiguous(), (b * scaling).contiguous())
        rank = max(rank, r)
    hidden = layout.hidden_size
    if head is not None and (head.dim() != 2 or head.shape[1] != hidden):
        raise LoraError(f"the adapter's head {tuple(head.shape)} does not fit hidden size {hidden}")
    if not weights and head is None:
        raise LoraError(f"adapter {str(path)!r} holds no LoRA weights")
    labels = _head_labels(cfg, head)
    return LoraAdapter(name, path, rank, weights, head, labels)


def _head_labels(cfg: dict[str, Any], head: torch.Tensor | None) -> tuple[str, ...]:
    if head is None:
        return ()
    id2label = cfg.get("id2label") or {}
    if not isinstance(id2label, dict):
        raise LoraError(f"id2label must map class indices to labels, got {type(id2label).__name__}")
    return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(head.shape[0]))


def _pieces(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Per fused projection of a dense trunk's layer: its input size and its targets' output sizes."""
    shapes = _shapes(config)
    return {p: (shapes[ts[0]][0], [shapes[t][1] for t in ts]) for p, ts in FUSED.items()}


def _layer_pieces(layout: LoraLayout) -> list[dict[str, tuple[int, list[int]]]]:
    """Per layer and projection: its input size and its targets' output sizes."""
    return [{p.name: (p.fan_in, p.outs) for p in layer} for layer in layout.layers]


def _stream_layouts(pieces: list[dict[str, tuple[int, list[int]]]], max_rank: int,
                    dtype: torch.dtype) -> dict[tuple[int, str], StreamLayout] | None:
    """Every layer's projections' StreamLayout, or None where the C kernels take row-major
    slots (the kernel built without AVX512-BF16, float32, or a projection too wide)."""
    kernel = load_lora_kernel()
    if kernel is None:
        return None
    by_shape: dict[tuple[int, tuple[int, ...]], StreamLayout | None] = {}
    layouts: dict[tuple[int, str], StreamLayout] = {}
    for layer, projections in enumerate(pieces):
        for p, (fan_in, outs) in projections.items():
            key = (fan_in, tuple(outs))
            if key not in by_shape:
                by_shape[key] = kernel.stream_layout(dtype, fan_in, len(outs) * max_rank,
                                                     [sum(outs[:j]) for j in range(len(outs) + 1)])
            found = by_shape[key]
            if found is None:
                return None
            layouts[(layer, p)] = found
    return layouts


class LoraSlots:
    """`num_slots` resident adapters' stacked A/B per layer and fused projection (device
    memory the executor owns; `nbytes` is counted in its budget). `config`: a dense
    trunk's (dense_layout), or the model's own LoraLayout."""

    def __init__(self, config: ModelConfig | LoraLayout, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError("LoRA needs at least one slot and a rank of at least 1")
        self.layout = layout_of(config)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self._pieces = _layer_pieces(self.layout)
        self.heads: list[torch.Tensor | None] = [None] * num_slots
        # The all-slots path's operands reordered once for oneDNN (as model/layers/linear.py's
        # Projection does for decode-sized calls): unpacked, these small bf16 matmuls cost
        # a large share of a LoRA decode step. Made on first use after a load.
        # The C kernel serves decode where it loads; the packed copies are its fallback.
        self.kernel = load_lora_kernel() if self.device.type == "cpu" and dtype in CPU_KERNEL_DTYPES else None
        self.prepack = self.kernel is None and prepack_enabled(dtype, self.device)
        self._packed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        # Each projection's target column bounds (B is block diagonal): the C kernel reads
        # only the nonzero blocks (q/k/v: a third of B, gate/up: half).
        self.columns = {(layer, p): torch.tensor([sum(outs[:j]) for j in range(len(outs) + 1)], dtype=torch.int32)
                        for layer, projections in enumerate(self._pieces) for p, (_, outs) in projections.items()}
        # The slots, either way the kernels read them:
        # - on an AVX512-BF16 CPU in bf16, only in the C kernels' StreamLayout, streams[(layer,
        #   proj)] [S, stride] (each token's A and B one sequential stream; B's zero blocks
        #   not kept); torch's paths get row-major copies from `row_major` (a fallback);
        # - otherwise row-major, a[layer][proj] [S, in, k R] and b[layer][proj] [S, k R, out]
        #   (a slot's A and B contiguous: the C kernel and the grouped path read one block).
        layouts = _stream_layouts(self._pieces, max_rank, dtype) if self.kernel is not None else None
        self.streams: dict[tuple[int, str], tuple[StreamLayout, torch.Tensor]] = {}
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        if layouts is not None:
            for key, layout in layouts.items():
                self.streams[key] = (layout, torch.zeros(num_slots, layout.stride, dtype=dtype))
        else:
            for projections in self._pieces:
                a, b = {}, {}
                for p, (fan_in, outs) in projections.items():
                    width = len(outs) * max_rank
                    a[p] = torch.zeros(num_slots, fan_in, width, dtype=dtype, device=self.device)
                    b[p] = torch.zeros(num_slots, width, sum(outs), dtype=dtype, device=self.device)
                self.a.append(a)
                self.b.append(b)
        # What the kernel's calls pass, per layer and projection (None where it does not fit).
        self.operands: dict[tuple[int, str], SlotOperands | None] = {}
        if self.kernel is not None:
            for layer, projections in enumerate(self._pieces):
                for p in projections:
                    if self.streams:
                        layout, streams = self.streams[(layer, p)]
                        self.operands[(layer, p)] = self.kernel.stream_operands(layout, streams,
                                                                                self.columns[(layer, p)])
                    else:
                        self.operands[(layer, p)] = self.kernel.operands(self.a[layer][p], self.b[layer][p],
                                                                         self.columns[(layer, p)])

    @property
    def nbytes(self) -> int:
        return LoraSlots.bytes_for(self.layout, self.num_slots, self.max_rank, self.dtype, self.device)

    def holds(self, layer: int, proj: str) -> bool:
        """Whether adapters may target projection `proj` of `layer`."""
        return proj in self._pieces[layer]

    @staticmethod
    def bytes_for(config: ModelConfig | LoraLayout, num_slots: int, max_rank: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> int:
        """Device bytes of a LoraSlots, before building one (the memory budget): the slots,
        and their oneDNN copies where the CPU prepacks."""
        pieces = _layer_pieces(layout_of(config))
        device = torch.device(device)
        kernel = device.type == "cpu" and dtype in CPU_KERNEL_DTYPES and load_lora_kernel() is not None
        layouts = _stream_layouts(pieces, max_rank, dtype) if kernel else None
        if layouts is not None:
            total = sum(layout.stride for layout in layouts.values())
        else:
            copies = 2 if not kernel and prepack_enabled(dtype, device) else 1
            total = copies * sum(len(outs) * max_rank * (fan_in + sum(outs))
                                 for projections in pieces for fan_in, outs in projections.values())
        return total * num_slots * dtype.itemsize

    def row_major(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A projection's slots as A [S, in, k R] and block-diagonal B [S, k R, out]: the
        slots themselves, or made from the StreamLayout (torch's paths, a fallback)."""
        if not self.streams:
            return self.a[layer][proj], self.b[layer][proj]
        layout, streams = self.streams[(layer, proj)]
        return layout.unpack(streams)

    def packed(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """oneDNN copies of a projection's A [slots k R, in] and B [out, slots k R] (None
        where the CPU does not prepack)."""
        key = (layer, proj)
        found = self._packed.get(key)
        if found is None and self.prepack:
            bound_onednn_caches()
            a, b = self.row_major(layer, proj)
            try:
                found = self._packed[key] = (
                    torch.ops.mkldnn._reorder_linear_weight(a.transpose(1, 2).reshape(-1, a.shape[1]), None),
                    torch.ops.mkldnn._reorder_linear_weight(b.flatten(0, 1).t().contiguous(), None))
            except (RuntimeError, AttributeError):  # op missing, or no bf16 reorder on this CPU
                self.prepack = False
        return found

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot` (replacing what was there)."""
        if adapter.rank > self.max_rank:
            raise LoraError(f"rank {adapter.rank} is over --max-lora-rank {self.max_rank}")
        self.clear(slot)  # (drops the packed copies too)
        r = self.max_rank
        staged: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # row-major, for the streams
        for (layer, target), (a, b) in adapter.weights.items():
            projection, j = self.layout.place(layer, target)
            proj = projection.name
            fan_in, outs = self._pieces[layer][proj]
            off = sum(outs[:j])
            rank = a.shape[0]
            if self.streams:
                if (layer, proj) not in staged:
                    staged[(layer, proj)] = (torch.zeros(fan_in, len(outs) * r, dtype=self.dtype),
                                             torch.zeros(len(outs) * r, sum(outs), dtype=self.dtype))
                a_slot, b_slot = staged[(layer, proj)]
            else:
                a_slot, b_slot = self.a[layer][proj][slot], self.b[layer][proj][slot]
            a_slot[:, j * r : j * r + rank].copy_(a.t())
            b_slot[j * r : j * r + rank, off : off + outs[j]].copy_(b.t())
        for key, (a_slot, b_slot) in staged.items():
            layout, streams = self.streams[key]
            streams[slot].copy_(layout.pack(a_slot, b_slot))
        self.heads[slot] = None if adapter.head is None else adapter.head.to(self.dtype).to(self.device)

    def clear(self, slot: int) -> None:
        for layer in (*self.a, *self.b):
            for t in layer.values():
                t[slot].zero_()
        for _, streams in self.streams.values():
            streams[slot].zero_()
        self.heads[slot] = None
        self._packed.clear()


@dataclass(frozen=True)
class LoraBatch:
    """This forward's adapter per token: `token_slots` [T] on the device (-1: the base);
    on the CPU, either `one_hot` [T, slots] (few tokens: the masked all-slots path) or each
    slot's rows for the grouped path (a slice when contiguous, else an index tensor)."""

    token_slots: torch.Tensor
    groups: tuple[tuple[int, slice | torch.Tensor], ...]
    one_hot: torch.Tensor | None = None
    device_index: bool = False  # only `token_slots` is valid (a captured graph's static input)
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def on_device(token_slots: torch.Tensor) -> "LoraBatch":
        """A batch that reads only the per-token index, whatever values it holds when the
        forward runs (a captured graph's static input): the Triton kernels on CUDA, the C
        kernel on a CPU."""
        return LoraBatch(token_slots, (), None, device_index=True)

    @staticmethod
    def build(row_slots: Sequence[int], row_lens: Sequence[int], device: torch.device | str,
              num_slots: int = 0) -> "LoraBatch | None":
        """From each row's slot (-1: base) and token count; None when every row is the base
        (the plain forward). `num_slots`: the resident slots (the all-slots path's width)."""
        if all(s < 0 for s in row_slots):
            return None
        device = torch.device(device)
        per_token = [s for s, n in zip(row_slots, row_lens) for _ in range(n)]
        token_slots = torch.tensor(per_token, dtype=torch.long)
        groups: list[tuple[int, slice | torch.Tensor]] = []
        if device.type == "cpu" and num_slots > 0 and len(per_token) <= DENSE_MAX_TOKENS:
            one_hot = torch.zeros(len(per_token), num_slots)
            rows = [i for i, s in enumerate(per_token) if s >= 0]
            one_hot[rows, [per_token[i] for i in rows]] = 1.0
            return LoraBatch(token_slots, (), one_hot)
        if device.type == "cpu":
            start = 0
            spans: dict[int, list[tuple[int, int]]] = {}
            for s, n in zip(row_slots, row_lens):
                if s >= 0 and n:
                    spans.setdefault(s, []).append((start, start + n))
                start += n
            for s, runs in spans.items():
                if all(a == b for (_, b), (a, _) in zip(runs, runs[1:])):  # one contiguous run
                    groups.append((s, slice(runs[0][0], runs[-1][1])))
                else:
                    groups.append((s, torch.cat([torch.arange(a, b) for a, b in runs])))
        return LoraBatch(token_slots.to(device, non_blocking=True), tuple(groups))

    def delta_into(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """out[t] += (x[t] @ a[slot t]) @ b[slot t] for every token of an adapter (a:
        [slots, in, k R], b: [slots, k R, out]; `packed`: their oneDNN copies, see
        LoraSlots.packed); returns out, or a new tensor holding the sum."""
        if out.device.type == "cuda":
            from prelude.kernels.triton.lora import lora_delta_

            return lora_delta_(out, x, a, b, self.token_slots)
        assert not self.device_index, "a graph's adapter index needs the C kernel on a CPU"
        if self.one_hot is not None:
            mask = self._mask(a.shape[2], x.dtype)
            if packed is not None:
                lp = torch.ops.mkldnn._linear_pointwise
                shrunk = lp(x.contiguous(), packed[0], None, "none", [], "").mul_(mask)
                return lp.binary(shrunk, out.contiguous(), packed[1], None, "add")
            return out.addmm_((x @ a.permute(1, 0, 2).reshape(a.shape[1], -1)).mul_(mask), b.flatten(0, 1))
        for slot, rows in self.groups:
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ a[slot], b[slot])
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a[slot]) @ b[slot])
        return out

    def _mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots * width]: 1 on the columns of each token's own slot (made once per
        forward and projection width)."""
        mask = self._masks.get((width, dtype))
        if mask is None:
            assert self.one_hot is not None
            mask = self._masks[(width, dtype)] = self.one_hot.to(dtype).repeat_interleave(width, dim=1)
        return mask


class LoraLinear:
    """A projection operand plus this batch's adapters: what `linear(x, w)` calls."""

    __slots__ = ("base", "bias", "slots", "layer", "proj", "batch", "decode")

    def __init__(self, base: Linear, bias: torch.Tensor | None, slots: LoraSlots, layer: int, proj: str,
                 batch: LoraBatch) -> None:
        self.base, self.bias, self.slots, self.layer, self.proj, self.batch = base, bias, slots, layer, proj, batch
        # A few-token call's C kernel and operands, found once a step: decode makes about a
        # hundred calls, each a short base projection, where every microsecond of Python shows.
        kernel = slots.kernel
        ops = slots.operands.get((layer, proj)) if kernel is not None else None
        few = batch.one_hot is not None or batch.device_index
        self.decode = (kernel, ops) if few and ops is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.base, self.bias)
        if self.decode is not None:
            kernel, ops = self.decode
            if x.dtype == out.dtype == ops.dtype:
                return kernel.decode_(out, x if x.stride(-1) == 1 else x.contiguous(), self.batch.token_slots, ops)
        s, layer, proj, batch = self.slots, self.layer, self.proj, self.batch
        kernel = s.kernel
        if kernel is not None and out.dtype == x.dtype and batch.one_hot is None and not batch.device_index:
            ops = s.operands.get((layer, proj))
            if ops is not None and ops.dtype == x.dtype and kernel.grouped and x.dtype == torch.bfloat16:
                return kernel.run_(out, x if x.stride(-1) == 1 else x.contiguous(), batch.token_slots, ops,
                                   grouped=True)
        a, b = s.row_major(layer, proj)
        packed = s.packed(layer, proj) if batch.one_hot is not None else None
        return batch.delta_into(out, x, a, b, packed)


@dataclass(frozen=True)
class LoraStep:
    """What a forward needs for adapters: the resident slots and this batch's index."""

    slots: LoraSlots
    batch: LoraBatch

    def linear(self, layer: int, proj: str, base: Linear) -> Linear:
        """`base` plus the adapters' delta where they may target `proj` of `layer` (else `base`)."""
        if not self.slots.holds(layer, proj):
            return base
        return LoraLinear(base, None, self.slots, layer, proj, self.batch)

    def pre_attention(self, layer: int, w: PreAttention) -> PreAttention:
        return w._replace(qkv=LoraLinear(w.qkv, w.qkv_bias, self.slots, layer, "qkv", self.batch), qkv_bias=None)

    def post_attention(self, layer: int, w: PostAttention) -> PostAttention:
        s, batch = self.slots, self.batch
        if w.gate_up is None or w.down is None:  # a mixture of experts: adapters on it are refused at load
            return w._replace(o_proj=LoraLinear(w.o_proj, None, s, layer, "o_proj", batch))
        return w._replace(o_proj=LoraLinear(w.o_proj, None, s, layer, "o_proj", batch),
                          gate_up=LoraLinear(w.gate_up, None, s, layer, "gate_up", batch),
                          down=LoraLinear(w.down, None, s, layer, "down", batch))
