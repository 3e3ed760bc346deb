"""The "cpu" attention backend: paged attention in C over the block pool (cpu_attention.c).

One library call per layer serves every row of the forward (prefill rows over a cached
prefix plus new tokens, OneShot or chunked, decode rows, multi-item segments), reading K/V
through the block tables in place: no per-row Python loop, no gather of a prefix into a
contiguous copy, no mask tensor. The KV write is part of the same call, before any row
attends: a OneShot row may read prefix blocks another row of the same forward writes (the
scheduler's riders). float32 and bf16; the softmax and sums are float32 (on an
AVX512-BF16 CPU the bf16 products run on its bf16 dot-product instruction, P rounded to
bf16 for P·V; on an AMX-BF16 CPU the prefill rows' products run on the tile unit).

Built on first use for this CPU (native_lib.py, -march=native, cached per ISA); `load_cpu_attention()` is
None without a compiler or AVX2+FMA, or with PRELUDE_CPU_ATTENTION=0, and the backend
registry then falls back to torch SDPA (torch_backend.py). Anything the kernel does not
take (another dtype, a CUDA tensor) goes to the torch backend as well.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from prelude.kernels.cpu.cpu_attention import (
    MAX_HEAD_DIM,
    OPT_ALL_WIDE,
    OPT_AMX,
    CpuAttentionKernel,
    load_cpu_attention_kernel,
)
from prelude.model.attention.metadata import AttentionMetadata, PrefillTensors
from prelude.model.attention.torch_backend import TorchAttention

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
AMX_SWITCH = "PRELUDE_CPU_AMX"


@dataclass(frozen=True)
class _Rows:
    """A forward's row tensors as the C call reads them (int64, contiguous), and the call's
    row arguments made from them once per forward (every layer passes the same): the tensors
    are kept here while the pointers in `args` refer to them."""

    pre: PrefillTensors | None
    dec_index: torch.Tensor | None
    dec_lens: torch.Tensor | None
    dec_tables: torch.Tensor | None
    segments: torch.Tensor | None
    slots: torch.Tensor | None
    pre_args: tuple[int | None, ...]  # prefill rows
    rest_args: tuple[int | None, ...]  # decode rows, segments, slots


def _row_args(pre: PrefillTensors | None, dec_index: torch.Tensor | None, dec_lens: torch.Tensor | None,
              dec_tables: torch.Tensor | None, segments: torch.Tensor | None,
              slots: torch.Tensor | None) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    if pre is None:
        pre_args: tuple[int | None, ...] = (0, None, None, None, None, None, 0)
    else:
        pre_args = (pre.query_lens.numel(), ptr(pre.query_start), ptr(pre.query_lens), ptr(pre.context_lens),
                    ptr(pre.own_kv_in_cache), ptr(pre.block_tables), pre.block_tables.stride(0))
    return pre_args, (
        0 if dec_index is None else dec_index.numel(), ptr(dec_index), ptr(dec_lens), ptr(dec_tables),
        0 if dec_tables is None else dec_tables.stride(0),
        ptr(segments), ptr(slots), 0 if slots is None else slots.numel(),
    )


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _prefill_tensors(meta: AttentionMetadata) -> PrefillTensors | None:
    """The runner's PrefillTensors, or (metadata built elsewhere) the same from the slices."""
    if meta.prefill_tensors is not None:
        return meta.prefill_tensors
    if not meta.prefills:
        return None
    width = max(s.block_table.numel() for s in meta.prefills)
    tables = torch.zeros(len(meta.prefills), max(width, 1), dtype=torch.int64)
    for i, s in enumerate(meta.prefills):
        tables[i, : s.block_table.numel()] = s.block_table
    cols = torch.tensor([[s.query_start, s.query_len, s.context_len, int(s.own_kv_in_cache)] for s in meta.prefills],
                        dtype=torch.int64).t().contiguous()
    return PrefillTensors(cols[0], cols[1], cols[2], cols[3], tables, max(s.query_len for s in meta.prefills))


class CpuAttention:
    """Same protocol as TorchAttention: write new K/V, attend, return [T, Hq, D]."""

    name = "cpu"
    reads_prefill_tensors = False  # a CPU backend: no captured graphs
    attends_tails = True  # forward(..., tail_queries=): only each prefill row's last queries
    takes_window = True  # forward(..., window=): a sliding-window layer
    devices = ("cpu",)

    def __init__(self, kernel: CpuAttentionKernel, amx: bool | None = None) -> None:
        """amx: None takes the AMX form where it runs (unless PRELUDE_CPU_AMX=0); False never
        takes it (the dot-product form); True takes it where it runs."""
        self._kernel = kernel
        self._attend = kernel.attend
        self._write = kernel.write
        # bf16 tensors take the bf16 dot-product forms (this build has AVX512-BF16)
        self.bf16_dot_product = kernel.bf16_forms
        # bf16 prefill rows take the AMX tile unit where this build has it and the OS grants it
        # (PRELUDE_CPU_AMX=0: the dot-product form, to compare the two on one machine)
        wanted = os.environ.get(AMX_SWITCH, "1") != "0" if amx is None else amx
        self.amx = wanted and kernel.amx_ready
        # Every row in the wide form, decode rows included (make_batch_invariant)
        self.all_wide = False
        self._fallback = TorchAttention()
        # (metadata, its row tensors): every layer of a forward gets the same metadata object,
        # or one of two (the sliding layers' own, AttentionMetadata.window): the last two kept
        self._prepared: list[tuple[AttentionMetadata, _Rows]] = []

    def _rows(self, meta: AttentionMetadata) -> _Rows:
        for seen, rows in self._prepared:
            if seen is meta:
                return rows
        pre = _prefill_tensors(meta)
        if pre is not None:
            pre = PrefillTensors(_i64(pre.query_start), _i64(pre.query_lens), _i64(pre.context_lens),
                                 _i64(pre.own_kv_in_cache), _i64(pre.block_tables), pre.max_query_len)
        dec = meta.decodes
        dec_index = _i64(dec.query_index) if dec is not None else None
        dec_lens = _i64(dec.context_lens) if dec is not None else None
        dec_tables = _i64(dec.block_tables) if dec is not None else None
        segments = _i64(meta.segment_ids) if meta.segment_ids is not None else None
        slots = _i64(meta.slot_mapping) if meta.slot_mapping is not None else None
        rows = _Rows(pre, dec_index, dec_lens, dec_tables, segments, slots,
                     *_row_args(pre, dec_index, dec_lens, dec_tables, segments, slots))
        self._prepared = [(meta, rows), *self._prepared[:1]]
        return rows

    def make_batch_invariant(self) -> None:
        """A token's output then never depends on how it was computed: every row takes the
        wide form, decode rows and prefill rows of 1-3 new tokens included (they took the
        narrow one, whose sums differ in the last bits). So a prompt token comes out the same
        however much of its prompt the prefix cache held, and a cached block written by
        another request's decode steps holds what a prompt would have written. How a row
        splits into items does not move bits. Decode rows then use 3 of a vector's 16 lanes
        (the AMX form always does so)."""
        self.all_wide = True

    @property
    def options(self) -> int:
        """cpu_attention.c's options for this backend's choices (the AMX form, all rows wide)."""
        return (OPT_AMX if self.amx else 0) | (OPT_ALL_WIDE if self.all_wide else 0)

    @property
    def entry_point(self) -> int:
        """The address of prelude_paged_attention (layer_loop.c calls it)."""
        return self._kernel.attend_address

    def row_arguments(self, meta: AttentionMetadata) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
        """The call's row arguments for `meta` (its prefill rows; its decode rows, segments
        and slots), made once per forward and kept alive here until the next forward's."""
        rows = self._rows(meta)
        return rows.pre_args, rows.rest_args

    def describe(self, dtype: torch.dtype) -> str:
        """What serves `dtype` here, for the start-up log."""
        if dtype == torch.bfloat16:
            if not self.bf16_dot_product:
                return "C paged kernel, float32 math (no AVX512-BF16 in this build)"
            return ("C paged kernel, bf16 products on AMX tiles, prefill and decode (the AVX512-BF16 dot product "
                    "with PRELUDE_CPU_AMX=0), float32 softmax" if self.amx else
                    "C paged kernel, bf16 products on the AVX512-BF16 dot product, float32 softmax")
        if dtype == torch.float32:
            return "C paged kernel, float32"
        return "torch SDPA (the C kernel takes float32 and bfloat16)"

    def serves(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype
                and q.shape[-1] <= MAX_HEAD_DIM)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """Scatter new tokens' K/V ([T, H_kv, D]) into their pool slots; slot -1: not kept."""
        k, v = self._last_contiguous(k), self._last_contiguous(v)
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k.dtype != k_cache.dtype:
            raise ValueError("K/V caches must share strides and the new K/V's dtype, with a contiguous head_dim")
        t, kv_heads, head_dim = k.shape
        rc = self._write(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                         k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                         k_cache.stride(2), k_cache.shape[1], slots.data_ptr(), t, kv_heads, head_dim,
                         k.element_size(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("cpu_attention.c refused the arguments of write_kv")

    @staticmethod
    def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
        return x if x.stride(-1) == 1 else x.contiguous()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        tail_queries: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """`tail_queries` ([prefill rows] int64, or None: all): attend only each prefill
        row's last so many queries; the other rows of the result are left unwritten (their
        K/V are written all the same). Decode rows are always attended. `window`: a
        sliding-window layer's span (each query sees its last `window` positions, itself
        included; table entries wholly before a row's window are never read); None: all."""
        if not self.serves(q, k_cache):
            return self._fallback.forward(q, k, v, k_cache, v_cache, meta, scale, window=window)
        rows = self._rows(meta)
        tail = None
        if tail_queries is not None:
            tail = _i64(tail_queries)
            if tail.numel() != (0 if rows.pre is None else rows.pre.query_lens.numel()):
                raise ValueError("tail_queries needs one count per prefill row")
        q, k, v = self._last_contiguous(q), self._last_contiguous(k), self._last_contiguous(v)
        if rows.slots is not None and (k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
                                       or k.dtype != k_cache.dtype or rows.slots.numel() != k.shape[0]):
            raise ValueError("K/V caches must share strides and the new K/V's dtype, with a contiguous head_dim, "
                             "and every new token needs a slot")
        out = torch.empty_like(q)
        rc = self._attend(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.shape[1], *rows.pre_args, None if tail is None else tail.data_ptr(), *rows.rest_args,
            out.data_ptr(), out.stride(0), out.stride(1),
            q.shape[1], k_cache.shape[2], q.shape[2], scale, _DTYPES[q.dtype], torch.get_num_threads(), self.options,
            window or 0,
        )
        if rc != 0:
            raise RuntimeError(f"cpu_attention.c refused the forward's arguments (code {rc})")
        return out


def load_cpu_attention() -> CpuAttention | None:
    """The backend, built on first use on this machine; None where the kernel cannot run."""
    kernel = load_cpu_attention_kernel()
    return None if kernel is None else CpuAttention(kernel)
