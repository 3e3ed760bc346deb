"""A decoder's layer loop for small CPU steps in one C call (kernels/cpu/layer_loop.c).

The loop over fused_segments.py's first/between/last makes ~270 kernel calls a SmolLM2-135M
step, each through ctypes with its Python around it, and that overhead is a sizeable share
of a small decode step. layer_loop.c calls the same kernels
in the same order on the same kind of buffers, through the entry points of the libraries
that hold them, so its hidden states (and the K/V it writes) are bit for bit the Python
loop's, the last layer for the read positions only included.

It takes a step when the model runs on the CPU fused kernels and the C attention backend,
every projection has a C route for the step's rows, and the step has no LoRA adapters and
no multi-item segments: in bf16, steps of up to TILE_MAX_ROWS tokens (decode rows, short
prompts or both) through the GGUF blocks up to their bound, else bf16_rows.c's tile form
(which needs AMX), and of up to amx_gemm.c's max_rows (128 in its tile form) where it
serves every projection's calls past the tile form's bound (a 128-token prompt); on a CPU
with AVX512-BF16 and no AMX (no tile forms), steps of up to the dot-product form's max_rows
(2,048: the judge's steps of 16 x 64 new tokens, where the C loop is at least even with
the Python loop over the same kernels) where it serves every projection's calls past the blocks'
bound; in float32, steps of up to f32_gemm.c's max_rows (2,048) where it serves every
projection's calls past the blocks' bound (a CPU with AVX2 and no AVX-512: prompts as well
as decode rows), else of as many tokens as every projection's GGUF blocks take
(decode_routes.py's bound, measured on each CPU), the few-row calls oneDNN
would otherwise serve being out of C's reach. Every other step runs the Python loop.
Under batch invariance (run-batch) every projection's one route is its own GEMM at every
row count where one serves, and the loop, rebuilt then (after the attention backend took
its invariant choice), calls it so too and passes the backend's options (every row wide).
PRELUDE_LAYER_LOOP=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence

import torch

from prelude.config import ModelConfig
from prelude.kernels.cpu.layer_loop import (
    ROUTE_SLOTS,
    SWITCH,
    LayerStruct,
    ModelStruct,
    ProjStruct,
    StepStruct,
    load_layer_loop,
)
from prelude.model.attention.cpu_backend import CpuAttention
from prelude.model.attention.metadata import AttentionMetadata
from prelude.kernels.cpu.cpu_fused import CpuFusedKernels, load_cpu_kernels
from prelude.kernels.ggml_quants import KINDS
from prelude.model.layers.linear import C_ROUTES, Projection
from prelude.model.read_positions import ReadPositions

logger = logging.getLogger("prelude.model.fast_paths.layer_loop")


def _tensor_ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class LayerLoop:
    """The loaded library bound to one model's weights (see the module docstring)."""

    def __init__(self, fn: ctypes._CFuncPtr, kernels: CpuFusedKernels, attention: CpuAttention, layers: Sequence,
                 final_norm: torch.Tensor, config: ModelConfig, scale: float, dtype: torch.dtype) -> None:
        self._fn = fn
        self._layers = list(layers)  # the weights the C structs point at stay alive with these
        self._attention = attention
        self._final_norm = final_norm
        self.dtype = dtype
        self.hidden, self.heads, self.head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        self.kv_heads, self.inter = config.num_key_value_heads, config.intermediate_size
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # the step's buffers (the C Step's names), each [rows, width] in one allocation a step
        self._widths = {"h_a": self.hidden, "h_b": self.hidden, "normed": self.hidden,
                        "qkv": q_width + 2 * kv_width, "q": q_width, "k": kv_width, "v": kv_width, "attn": q_width,
                        "proj": self.hidden, "gate_up": 2 * self.inter, "act": self.inter}
        self._xsum_width = max(self.hidden, self.inter, q_width) // 32  # the blocks' per-block input sums
        projections = _projections(self._layers)
        # the kernels' entry points, from the projections that have them (each route is one
        # library's function, whichever projection names it)
        tile = next((p.tile_form for p in projections if p.tile_form is not None), None)
        gemm = next((g for g in (p.own_gemm for p in projections) if g is not None), None)
        blocks = next((p.blocks.kernel for p in projections if p.blocks is not None), None)
        norm, rope, silu = kernels.entry_points()
        self._model = ModelStruct(
            norm=norm, rope=rope, silu=silu, rows=None if tile is None else tile.entry_point,
            gemm=None if gemm is None else gemm.entry_point,
            blocks=None if blocks is None else blocks.entry_point(dtype), attend=attention.entry_point,
            n_layers=len(self._layers), hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, inter=self.inter, eps=config.rms_norm_eps, scale=scale,
            final_norm=final_norm.data_ptr(), attend_options=attention.options, bf=int(dtype == torch.bfloat16))
        self._table = (LayerStruct * len(self._layers))()
        self._bound: tuple[int, ...] = ()  # the K/V pools the table points at (list, first and last pool)
        self._max_rows = 0  # the routes' bound the table was bound with (see max_rows)

    @property
    def max_rows(self) -> int:
        """The most tokens a step may have for every projection call to have a C route: the
        own GEMM's bound (amx_gemm.c, f32_gemm.c), the tile form's (bf16 on AMX), or the
        fewest rows any projection's blocks take (float32 without f32_gemm.c: the blocks
        alone). Read from the projections until the first step binds the table; from then
        on, what the table holds."""
        return self._max_rows if self._bound else min(_c_rows(p, self.dtype) for p in _projections(self._layers))

    def takes(self, rows: int, meta: AttentionMetadata, reads: ReadPositions | None) -> bool:
        """Whether a step of `rows` tokens runs here: up to max_rows of them (decode rows and
        prompts' rows alike), no multi-item segments, no adapters on the read rows, and some
        position read."""
        return (0 < rows <= self.max_rows and meta.segment_ids is None
                and (meta.slot_mapping is None or meta.slot_mapping.numel() == rows)
                and (reads is None or (reads.lora is None and reads.index.numel() > 0)))

    def _bind(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the layer table at the weights and at `kv_caches` (once per pool)."""
        k0 = kv_caches[0][0]
        for k_cache, v_cache in kv_caches:
            if k_cache.stride() != k0.stride() or v_cache.stride() != k0.stride() or k_cache.stride(-1) != 1:
                raise ValueError("the K/V pools of every layer must share one layout with a contiguous head_dim")
        for entry, layer, (k_cache, v_cache) in zip(self._table, self._layers, kv_caches, strict=True):
            entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            entry.q_norm, entry.k_norm = _tensor_ptr(layer.q_norm), _tensor_ptr(layer.k_norm)
            entry.qkv, entry.o, entry.gate_up, entry.down = (_proj(p, self.dtype) for p in layer.projections)
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self._model.layers = self._table
        self._model.scb, self._model.scs, self._model.sch = k0.stride(0), k0.stride(1), k0.stride(2)
        self._model.block_size = k0.shape[1]
        self._max_rows = min(_c_rows(p, self.dtype) for p in _projections(self._layers))
        self._bound = _pools_key(kv_caches)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], reads: ReadPositions | None = None) -> torch.Tensor:
        """The final-normed hidden states of a step `takes` accepts, from the embeddings `h` and
        the gathered rotary tables: [rows, hidden], or with `reads` those of the read positions
        only, in their order (the last layer computed for them alone, as the model's own)."""
        if self._bound != _pools_key(kv_caches):
            self._bind(kv_caches)
        rows = h.shape[0]
        pre, rest = self._attention.row_arguments(meta)
        n_pre, pre_start, pre_len, pre_ctx, pre_own, pre_tables, pre_tstride = pre
        n_dec, dec_index, dec_ctx, dec_tables, dec_tstride, _segments, slots, n_slots = rest
        read_index = pre_tail = None
        if reads is not None:  # the C side indexes with them unchecked: what index_select would refuse, refused here
            read_index = reads.index.to(torch.int64).contiguous()
            pre_tail = reads.tail_queries.to(torch.int64).contiguous()
            if pre_tail.numel() != n_pre or int(read_index.min()) < 0 or int(read_index.max()) >= rows:
                raise ValueError(f"read positions {reads.index.tolist()} with {pre_tail.numel()} tails for "
                                 f"{rows} tokens in {n_pre} prompt rows")
        n_read = rows if read_index is None else read_index.numel()
        scratch = torch.empty(rows * sum(self._widths.values()), dtype=self.dtype)
        ptrs, at = {}, scratch.data_ptr()
        for name, width in self._widths.items():
            ptrs[name] = at
            at += rows * width * scratch.element_size()
        xsum = torch.empty(rows * self._xsum_width + 1, dtype=torch.float32)
        out = torch.empty(n_read, self.hidden, dtype=self.dtype)
        h = h if h.is_contiguous() else h.contiguous()
        cos = cos if cos.is_contiguous() else cos.contiguous()
        sin = sin if sin.is_contiguous() else sin.contiguous()
        step = StepStruct(rows=rows, h_in=h.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), n_pre=n_pre,
                     pre_start=pre_start, pre_len=pre_len, pre_ctx=pre_ctx, pre_own=pre_own, pre_tables=pre_tables,
                     pre_tstride=pre_tstride, n_dec=n_dec, dec_index=dec_index, dec_ctx=dec_ctx, dec_tables=dec_tables,
                     dec_tstride=dec_tstride, slots=slots, n_slots=n_slots, n_read=n_read,
                     read_index=_tensor_ptr(read_index), pre_tail=_tensor_ptr(pre_tail), xsum=xsum.data_ptr(),
                     out=out.data_ptr(), threads=torch.get_num_threads(), **ptrs)
        rc = self._fn(ctypes.byref(self._model), ctypes.byref(step))
        if rc != 0:
            raise RuntimeError(f"layer_loop.c: a kernel refused its arguments (code {rc})")
        return out


def _projections(layers: Sequence) -> list[Projection]:
    return [p for layer in layers for p in layer.projections]


def _pools_key(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
    """What identifies the pools a layer table points at: the list, and its first and last
    pools' memory (a runner keeps one list for its life)."""
    return id(kv_caches), len(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr()


def _proj(p: Projection, dtype: torch.dtype) -> ProjStruct:
    """The projection as layer_loop.c reads it: its tensors and its routes (Projection.c_routes)."""
    routes = p.c_routes(dtype)
    upto = [bound for bound, _ in routes] + [0] * (ROUTE_SLOTS - len(routes))
    via = [C_ROUTES[route] for _, route in routes] + [-1] * (ROUTE_SLOTS - len(routes))
    blocks = p.blocks
    b = blocks.blocks if blocks is not None else None
    return ProjStruct(weight=p.weight.data_ptr(), bias=_tensor_ptr(p.bias), out=p.out_features, k=p.weight.shape[1],
                      kind=-1 if b is None else KINDS.index(b.kind), qs=None if b is None else b.qs.data_ptr(),
                      d=None if b is None else b.d.data_ptr(), mins=None if b is None else _tensor_ptr(b.m),
                      packed=_tensor_ptr(p.gemm_copy()), upto=(ctypes.c_int64 * ROUTE_SLOTS)(*upto),
                      via=(ctypes.c_int32 * ROUTE_SLOTS)(*via))


def _c_rows(p: Projection, dtype: torch.dtype) -> int:
    """The most rows every call of `p` has a C route for (0: none)."""
    routes = p.c_routes(dtype)
    return routes[-1][0] if routes else 0


def layer_loop_for(layers: Sequence, final_norm: torch.Tensor, attention: object, dtype: torch.dtype,
                   config: ModelConfig, scale: float) -> LayerLoop | None:
    """The C loop for a model's `layers` (DecoderLayer), or None where no step would run
    wholly in C here (see the module docstring)."""
    if (dtype not in (torch.bfloat16, torch.float32) or not isinstance(attention, CpuAttention)
            or os.environ.get(SWITCH, "1") == "0"):
        return None
    projections = _projections(layers)
    # every call of a step's rows needs a C route (Projection.route decides which), and the
    # blocks' GEMM for this dtype where a projection reads blocks
    if len(projections) != len(layers) * 4 or min(_c_rows(p, dtype) for p in projections) < 1:
        return None
    if any(p.blocks is not None and p.blocks.kernel.entry_point(dtype) is None for p in projections):
        return None
    kernels = load_cpu_kernels()
    fn = load_layer_loop()
    if kernels is None or fn is None:
        return None
    return LayerLoop(fn, kernels, attention, layers, final_norm, config, scale, dtype)


