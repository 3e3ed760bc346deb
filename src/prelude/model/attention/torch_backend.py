"""Paged attention in plain torch: runs on the CPU and on any GPU.

Layout of one layer's cache: [num_blocks, block_size, num_kv_heads, head_dim] for K and
for V. On the CPU (docs/design.md), looping prefills per sequence beats one
block-diagonal mask. Decode rows go through fused SDPA with GQA (sdpa_decode.py), which
beat the grouped matmuls + masked softmax used before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prelude.model.attention.metadata import AttentionMetadata, PrefillSlice
from prelude.model.attention.sdpa_decode import decode_attention


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    kept: torch.Tensor | None = None,
) -> None:
    """Scatter the new tokens' K/V ([T, H_kv, D]) into their cache slots; `kept` selects
    the tokens whose K/V are kept (None: all)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if kept is not None:
        slots, k, v = slots.index_select(0, kept), k.index_select(0, kept), v.index_select(0, kept)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, H_kv, D] of one sequence, read through its block table."""
    blocks = cache.index_select(0, block_table)  # [nb, bs, H, D]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def segment_mask(segments: torch.Tensor, context_len: int) -> torch.Tensor:
    """[n, context_len] visibility of a segmented row's n new tokens (ids `segments`)
    over its keys: the cached prefix (segment 0), then the new tokens themselves."""
    n = segments.numel()
    offset = context_len - n
    key_seg = torch.cat([segments.new_zeros(offset), segments])
    q_pos = torch.arange(n, device=segments.device).unsqueeze(1) + offset
    causal = torch.arange(context_len, device=segments.device).unsqueeze(0) <= q_pos
    same = (key_seg.unsqueeze(0) == 0) | (key_seg.unsqueeze(0) == segments.unsqueeze(1))
    return causal & same


def _prefill_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: PrefillSlice,
    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, segment_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """`window`: a query at position p sees the keys at positions above p - window only
    (a sliding-window layer), besides the causal and segment masks."""
    s, n = row.query_start, row.query_len
    q_row = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if row.segmented and segment_ids is not None:
        if row.own_kv_in_cache:
            k_row = _gather(k_cache, row.block_table, row.context_len)
            v_row = _gather(v_cache, row.block_table, row.context_len)
        elif row.context_len == n:
            k_row, v_row = k[s : s + n], v[s : s + n]
        else:
            cached = row.context_len - n
            k_row = torch.cat([_gather(k_cache, row.block_table, cached), k[s : s + n]])
            v_row = torch.cat([_gather(v_cache, row.block_table, cached), v[s : s + n]])
        mask = segment_mask(segment_ids[s : s + n], row.context_len)
        causal = False
    elif row.context_len == n:
        # Fresh prompt: its own K/V are all there is; skip the cache gather.
        k_row, v_row = k[s : s + n], v[s : s + n]
        mask = None
        causal = True
    else:
        if row.own_kv_in_cache:
            k_row = _gather(k_cache, row.block_table, row.context_len)
            v_row = _gather(v_cache, row.block_table, row.context_len)
        else:  # cached prefix from the pool + this forward's own K/V
            cached = row.context_len - n
            k_row = torch.cat([_gather(k_cache, row.block_table, cached), k[s : s + n]])
            v_row = torch.cat([_gather(v_cache, row.block_table, cached), v[s : s + n]])
        offset = row.context_len - n
        q_pos = torch.arange(n, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(row.context_len, device=q.device).unsqueeze(0) <= q_pos
        causal = False
    if window is not None:  # keys before the first query's window are left out, the rest masked
        first = max(0, row.context_len - n - window + 1)
        q_pos = torch.arange(n, device=q.device).unsqueeze(1) + (row.context_len - n)
        k_pos = torch.arange(first, row.context_len, device=q.device).unsqueeze(0)
        near = k_pos > q_pos - window
        mask = (near & (k_pos <= q_pos)) if mask is None else mask[:, first:] & near
        k_row, v_row = k_row[first:], v_row[first:]
        causal = False
    out = F.scaled_dot_product_attention(
        q_row,
        k_row.transpose(0, 1).unsqueeze(0),
        v_row.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)  # [n, Hq, D]


class TorchAttention:
    """The attention backend interface: write new K/V, attend, return [T, Hq, D]."""

    name = "torch"
    reads_prefill_tensors = False  # prefills run per row from host-side slices

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
        positions, itself included); None: every earlier position."""
        if meta.slot_mapping is not None:
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.kept_tokens)
        out = torch.empty_like(q)
        for row in meta.prefills:
            out[row.query_start : row.query_start + row.query_len] = _prefill_row(
                q, k, v, row, k_cache, v_cache, scale, meta.segment_ids, window
            )
        if meta.decodes is not None:
            out[meta.decodes.query_index] = decode_attention(q, meta.decodes, k_cache, v_cache, scale, window)
        return out
