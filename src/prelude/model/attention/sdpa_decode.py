"""Paged decode attention through torch's fused SDPA kernel (GQA without repeating K/V).

Each decode row's blocks are read through its block table into a [B, L, H_kv, D] view
(one index_select per K and V; a cheap copy at these sizes) and attended by
`scaled_dot_product_attention(enable_gqa=True)`, which on the CPU runs the fused flash
kernel: no [B, H, L] score tensor in float32, no separate mask/softmax/matmul ops.
It beat grouped matmuls + masked softmax at every batch and context tried, and
FlexAttention over the paged pool (a block mask per step, no gather) was slower than
both (docs/design.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prelude.model.attention.metadata import DecodeRows


def decode_attention(
    q: torch.Tensor, rows: DecodeRows, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] of the whole batch; returns [B, Hq, D] for the decode rows. `window`:
    each row sees its last `window` keys only (a sliding-window layer)."""
    batch = rows.query_index.numel()
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    length = rows.max_context_len
    nb = (length + block_size - 1) // block_size
    # A window: the blocks before every row's window are not read (on the CPU, where the
    # rows' lengths are at hand without a device sync)
    first = 0
    if window is not None and rows.context_lens.device.type == "cpu":
        first = max(0, int(rows.context_lens.min()) - window) // block_size
    start = first * block_size
    index = rows.block_tables[:, first:nb].reshape(-1)
    keys = k_cache.index_select(0, index).view(batch, (nb - first) * block_size, num_kv_heads, head_dim)
    values = v_cache.index_select(0, index).view(batch, (nb - first) * block_size, num_kv_heads, head_dim)
    keys, values = keys[:, :length - start], values[:, :length - start]
    positions = torch.arange(start, length, device=q.device)
    # One row's context length is the maximum by definition (unless max_context_len is
    # only a bound: a graph bucket's buffers): no padding to mask.
    mask = None
    if batch > 1 or not rows.max_is_a_row_len:
        mask = (positions < rows.context_lens.unsqueeze(1))[:, None, None, :]
    if window is not None:
        near = (positions >= (rows.context_lens - window).unsqueeze(1))[:, None, None, :]
        mask = near if mask is None else mask & near
    out = F.scaled_dot_product_attention(
        q.index_select(0, rows.query_index).unsqueeze(2),  # [B, Hq, 1, D]
        keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.squeeze(2)
