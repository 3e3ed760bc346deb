"""The "triton" attention backend: AttentionMetadata in, the Triton kernels out.

Meant for CUDA (the kernels also run on CPU tensors under TRITON_INTERPRET=1, which is how
the tests check them). The metadata-to-tensor conversion happens here, once per forward:
every layer receives the same AttentionMetadata object, so the converted tensors are kept
for that object and reused by the following layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillSlice, PrefillTensors
from prelude.kernels.triton.attention import (
    PrefillRows,
    decode_num_splits,
    paged_decode,
    prefill_attention,
    write_kv,
)


@dataclass(frozen=True)
class _DecodeTensors:
    query_index: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    num_splits: int


@dataclass(frozen=True)
class _LaunchInputs:
    slot_mapping: torch.Tensor | None
    prefill: PrefillRows | None
    decode: _DecodeTensors | None


def prefill_rows_from_tensors(t: PrefillTensors) -> PrefillRows:
    """The runner's device tensors as the kernel's rows, as they are (int64, no copy): the
    kernels read either width, and a CUDA graph's static buffers stay the ones read."""
    return PrefillRows(
        query_start=t.query_start,
        query_lens=t.query_lens,
        context_lens=t.context_lens,
        own_kv_in_cache=t.own_kv_in_cache,
        block_tables=t.block_tables,
        max_query_len=t.max_query_len,
    )


def prefill_rows(slices: tuple[PrefillSlice, ...], device: torch.device) -> PrefillRows:
    """The kernel's row tensors for the metadata's prefill slices (host-side, per forward;
    used when the metadata carries no `prefill_tensors`)."""
    width = max([1] + [s.block_table.numel() for s in slices])
    tables = torch.zeros(len(slices), width, dtype=torch.int32)
    for i, s in enumerate(slices):
        tables[i, : s.block_table.numel()] = s.block_table
    # one [4, R] tensor, one host-to-device copy; each row of it is a contiguous [R] view
    columns = torch.tensor(
        [
            [s.query_start for s in slices],
            [s.query_len for s in slices],
            [s.context_len for s in slices],
            [int(s.own_kv_in_cache) for s in slices],
        ],
        dtype=torch.int32,
    ).to(device, non_blocking=True)
    return PrefillRows(
        query_start=columns[0],
        query_lens=columns[1],
        context_lens=columns[2],
        own_kv_in_cache=columns[3],
        block_tables=tables.to(device, non_blocking=True),
        max_query_len=max(s.query_len for s in slices),
    )


def decode_tensors(rows: DecodeRows, num_kv_heads: int, device: torch.device) -> _DecodeTensors:
    return _DecodeTensors(
        query_index=rows.query_index.to(device, non_blocking=True),
        block_tables=rows.block_tables.to(device, non_blocking=True),
        context_lens=rows.context_lens.to(device, non_blocking=True),
        num_splits=decode_num_splits(rows.query_index.numel(), num_kv_heads, rows.max_context_len),
    )


class TritonAttention:
    """Same protocol as TorchAttention: write new K/V, attend, return [T, Hq, D]."""

    name = "triton"
    reads_prefill_tensors = True  # prefill rows come from device tensors: graph-capturable
    takes_window = True  # forward(..., window=): a sliding-window layer

    def __init__(self) -> None:
        # (metadata, its converted tensors): the last forward's, reused across its layers; the
        # last two kept (the sliding layers may read metadata of their own: AttentionMetadata.window)
        self._prepared: list[tuple[AttentionMetadata, _LaunchInputs]] = []

    def _inputs(self, meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> _LaunchInputs:
        for seen, ready in self._prepared:
            if seen is meta:
                return ready
        slots = meta.slot_mapping.to(device, non_blocking=True) if meta.slot_mapping is not None else None
        prefill = (prefill_rows_from_tensors(meta.prefill_tensors) if meta.prefill_tensors is not None
                   else prefill_rows(meta.prefills, device) if meta.prefills else None)
        if prefill is not None and meta.segment_ids is not None:  # multi-item rows (same ids, same meaning)
            prefill = replace(prefill, segment_ids=meta.segment_ids.to(device, non_blocking=True))
        inputs = _LaunchInputs(
            slot_mapping=slots,
            prefill=prefill,
            decode=decode_tensors(meta.decodes, num_kv_heads, device) if meta.decodes is not None else None,
        )
        self._prepared = [(meta, inputs), *self._prepared[:1]]
        return inputs

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """`window`: a sliding-window layer's span (each query sees its last `window`
        positions, itself included; table entries wholly before it are never read)."""
        inputs = self._inputs(meta, k_cache.shape[2], q.device)
        if inputs.slot_mapping is not None:
            write_kv(k_cache, v_cache, k, v, inputs.slot_mapping)
        out = torch.empty_like(q)
        if inputs.prefill is not None:
            prefill_attention(q, k, v, k_cache, v_cache, out, inputs.prefill, scale, window=window)
        if inputs.decode is not None:
            d = inputs.decode
            paged_decode(
                q, k_cache, v_cache, out, d.query_index, d.block_tables, d.context_lens, scale, num_splits=d.num_splits,
                window=window,
            )
        return out
