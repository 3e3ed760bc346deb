"""Paged attention kernels in Triton: KV write, varlen prefill over cached blocks, paged decode.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V
(the same as the torch backend). Every kernel reads the cache through block tables token by
token (slot = table[t // block_size] * block_size + t % block_size), so no row's K/V is ever
gathered into a contiguous copy and any block size works.

Launch discipline, so that CUDA graphs can capture these later: everything a kernel needs
per row arrives as a device tensor, and the launch path never reads a tensor's values on the
host (no `.item()`, `.tolist()`, no data-dependent shapes). Grid sizes come only from ints
the caller passes (`max_query_len`, `num_splits`) and from tensor shapes. Rows that a fixed
grid over-covers (a short row under `max_query_len`, a padded decode row with context 0) are
masked inside the kernel.

Softmax is online (running max and sum, rescaled per tile) in float32, in the log2 domain
(`exp2` with the scale pre-multiplied by log2(e)); inputs may be float32, float16 or bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# tl.dot wants every dimension >= 16 on the GPU; the tiles below never go under it.
_MIN_DOT = 16


def _dot_f32(dtype: torch.dtype) -> bool:
    """Upcast tl.dot operands to float32? Only under TRITON_INTERPRET, whose numpy dot treats
    bf16/fp16 operands as raw integers (triton 3.9); compiled kernels keep 16-bit MMA."""
    return dtype != torch.float32 and triton.knobs.runtime.interpret


def _pow2(n: int, floor: int = _MIN_DOT) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


# --- KV write --------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    K, V, KCache, VCache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # slot -1: this token's K/V are not kept (broadcast the scalar test to the tile)
    keep = (tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & keep
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new tokens' K/V ([T, H_kv, D]) into their cache slots; slot -1 = not kept."""
    _check_cache(k_cache, v_cache)
    _check_unit_stride(k, v, slot_mapping)
    t, num_kv_heads, head_dim = k.shape
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


# --- shared pieces ---------------------------------------------------------------------------


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_F32: tl.constexpr):
    """Fold one key tile into the running (acc, max, sum). q [M, D], k/v [N, D], visible [M, N]."""
    if DOT_F32:  # the interpreter's tl.dot mishandles 16-bit floats (see _dot_f32)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A query that has seen no visible key yet keeps max -inf; subtract 0 instead, so no
    # (-inf) - (-inf) appears and its exp2 terms stay exactly 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _load_cache_tile(Cache, table_row, pos, head, d, n_mask, d_mask, stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr):
    """[N, D] of one KV head at sequence positions `pos`, read through the block table."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head * stride_ch
    return tl.load(Cache + slot_off[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)


# --- varlen prefill --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillRows:
    """Rows with a query of one or more new tokens, as the prefill kernel reads them.

    Row r's queries are tokens [query_start[r], query_start[r] + query_lens[r]) of the
    flattened batch and sit at sequence positions [context_lens[r] - query_lens[r],
    context_lens[r]); the positions before that are the cached prefix, read through
    block_tables[r]. own_kv_in_cache[r] = 1: the new tokens' K/V are in the cache as well
    (chunked prefill, written before attention); 0: they are this forward's k/v tensors
    (OneShot). Queries see the prefix fully and the new tokens causally.

    segment_ids (optional, [T] int32 over the flattened batch): a per-new-token segment.
    Segment 0 is shared; a token of segment s > 0 sees the cached prefix, the segment-0 new
    tokens and, causally, the tokens of its own segment only. This is the multi-item scoring
    shape (a query segment 0, then item segments 1..N each seeing the query and itself); the
    caller restarts positions per item in the RoPE positions, the mask here needs only the
    ids. Cached-prefix keys always count as segment 0.
    """

    query_start: torch.Tensor  # [R] int32
    query_lens: torch.Tensor  # [R] int32
    context_lens: torch.Tensor  # [R] int32
    own_kv_in_cache: torch.Tensor  # [R] int32 (0/1)
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with 0
    max_query_len: int  # a fixed maximum from the caller: sizes the grid, never read back
    segment_ids: torch.Tensor | None = None


@triton.jit(do_not_specialize=["stride_table"])  # block-table width varies per step
def _prefill_kernel(
    Q, K, V, KCache, VCache, Out,
    query_start, query_lens, context_lens, own_kv_in_cache, block_tables, segment_ids,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_table,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    DOT_F32: tl.constexpr, WINDOW: tl.constexpr,
):
    row = tl.program_id(0)
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_len = tl.load(query_lens + row)
    if m_tile * BLOCK_M < q_len:  # the grid covers max_query_len; shorter rows stop here
        q0 = tl.load(query_start + row).to(tl.int64)
        ctx = tl.load(context_lens + row)
        prefix = ctx - q_len
        own_cached = tl.load(own_kv_in_cache + row)
        table_row = block_tables + row.to(tl.int64) * stride_table

        m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the row
        m_mask = m < q_len
        q_pos = prefix + m  # sequence position of each query
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = tl.load(Q + (q0 + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if HAS_SEGMENTS:
            q_seg = tl.load(segment_ids + q0 + m, mask=m_mask, other=0)

        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Causality bounds the keys this tile can see: up to its last query's position.
        kv_end = tl.minimum(ctx, prefix + (m_tile + 1) * BLOCK_M)
        # A window (a sliding layer): from the tile's first query's window on; the table's
        # entries before it are never read (a window table releases them)
        kv_begin = 0
        if WINDOW > 0:
            kv_begin = tl.maximum(prefix + m_tile * BLOCK_M - WINDOW + 1, 0)

        # 1) keys from the cache: the prefix, plus the new tokens when they were written.
        cache_end = tl.where(own_cached != 0, kv_end, tl.minimum(prefix, kv_end))
        for n0 in range(kv_begin, cache_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            n_mask = pos < cache_end
            k = _load_cache_tile(KCache, table_row, pos, kv_head, d, n_mask, d_mask,
                                 stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            v = _load_cache_tile(VCache, table_row, pos, kv_head, d, n_mask, d_mask,
                                 stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
            if HAS_SEGMENTS:
                # new tokens' keys carry their segment; prefix keys are shared (segment 0)
                k_seg = tl.load(segment_ids + q0 + (pos - prefix), mask=n_mask & (pos >= prefix), other=0)
                visible = visible & ((k_seg[None, :] == 0) | (k_seg[None, :] == q_seg[:, None]))
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_F32)

        # 2) keys of the new tokens from this forward's k/v (OneShot rows only).
        new_end = tl.where(own_cached != 0, prefix, kv_end)
        for n0 in range(tl.maximum(prefix, kv_begin), new_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            n_mask = pos < new_end
            tok = q0 + (pos - prefix)
            k = tl.load(K + tok[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            v = tl.load(V + tok[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
            if HAS_SEGMENTS:
                k_seg = tl.load(segment_ids + tok, mask=n_mask, other=0)
                visible = visible & ((k_seg[None, :] == 0) | (k_seg[None, :] == q_seg[:, None]))
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_F32)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + (q0 + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    rows: PrefillRows,
    scale: float,
    block_m: int | None = None,
    block_n: int = 32,
    window: int | None = None,
) -> None:
    """Attention of every prefill row's new tokens; writes out[query tokens] ([T, Hq, D]).
    `window`: a sliding layer's span (each query sees its last `window` positions).

    Padding rows (query_lens 0) and a max_query_len above the real one are allowed: the
    extra programs return at once, so a captured graph can serve smaller batches."""
    _check_cache(k_cache, v_cache)
    _check_unit_stride(q, k, v, out, rows.query_start, rows.query_lens, rows.context_lens, rows.own_kv_in_cache,
                       rows.block_tables, *([rows.segment_ids] if rows.segment_ids is not None else []))
    num_rows = rows.query_lens.shape[0]
    if num_rows == 0 or rows.max_query_len == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    if block_m is None:  # short queries (decode-like, OneShot tails) waste less with 16
        block_m = 16 if rows.max_query_len <= 16 else 64
    grid = (num_rows, triton.cdiv(rows.max_query_len, block_m), num_heads)
    segments = rows.segment_ids
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, out,
        rows.query_start, rows.query_lens, rows.context_lens, rows.own_kv_in_cache, rows.block_tables,
        segments if segments is not None else rows.query_lens,  # unread without segments
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), rows.block_tables.stride(0),
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1], HAS_SEGMENTS=segments is not None,
        DOT_F32=_dot_f32(q.dtype), WINDOW=window or 0,
    )


# --- paged decode ----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_table"])  # block-table width varies per step
def _decode_kernel(
    Q, KCache, VCache, Out, PartOut, PartLse,
    query_index, context_lens, block_tables,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_table,
    qk_scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
    WINDOW: tl.constexpr,
):
    # One program: one row, one KV head (all GROUP query heads sharing it, so each K/V tile
    # is loaded once for the group), one split of the context.
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(context_lens + row)
    tok = tl.load(query_index + row).to(tl.int64)
    table_row = block_tables + row.to(tl.int64) * stride_table
    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # Split the context (a window: its last WINDOW positions, the table's entries before
    # them never read) into NUM_SPLITS ranges of whole tiles (split-K for long contexts).
    begin = 0
    if WINDOW > 0:
        begin = tl.maximum(ctx - WINDOW, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(ctx - begin, BLOCK_N), NUM_SPLITS)
    start = begin + split * tiles_per_split * BLOCK_N
    end = tl.minimum(ctx, start + tiles_per_split * BLOCK_N)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        k = _load_cache_tile(KCache, table_row, pos, kv_head, d, n_mask, d_mask,
                             stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        v = _load_cache_tile(VCache, table_row, pos, kv_head, d, n_mask, d_mask,
                             stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        visible = g_mask[:, None] & n_mask[None, :]
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_F32)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty split or row gives 0
    io_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=io_mask)
    else:
        # partials [B, Hq, S, BLOCK_D] and their log2-sum-exp [B, Hq, S], contiguous
        num_heads = tl.num_programs(1) * GROUP
        part = (row.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(PartOut + part[:, None] * BLOCK_D + d[None, :], out, mask=io_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(PartLse + part, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    Out, PartOut, PartLse, query_index, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Combine the splits of one (row, query head): weights 2^(lse_s - max lse)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    tok = tl.load(query_index + row).to(tl.int64)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    base = (row.to(tl.int64) * num_heads + head) * NUM_SPLITS
    lse = tl.load(PartLse + base + s)
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)))
    parts = tl.load(PartOut + (base + s)[:, None] * BLOCK_D + d[None, :])
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + tok * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


def decode_num_splits(num_rows: int, num_kv_heads: int, max_context_len: int, target_programs: int = 128) -> int:
    """Splits per row (a power of two) so that long contexts with few rows still fill the
    device: a host-side choice from sizes the caller already knows (graph buckets fix it)."""
    splits = 1
    while (
        splits < 16
        and num_rows * num_kv_heads * splits < target_programs
        and max_context_len >= 2 * splits * 256  # each split keeps >= 256 keys
    ):
        splits *= 2
    return splits


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_index: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    block_n: int = 32,
    window: int | None = None,
) -> None:
    """Attention of decode rows (one query token each, at q[query_index]) over their cached
    context; writes out[query_index]. context_lens[r] = 0 (a padded row) writes zeros.
    `window`: a sliding layer's span (each row sees its last `window` positions)."""
    _check_cache(k_cache, v_cache)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    _check_unit_stride(q, out, query_index, block_tables, context_lens)
    num_rows = query_index.shape[0]
    if num_rows == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = _pow2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(num_rows, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_rows, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse,
        query_index, context_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * _LOG2E,
        GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1], NUM_SPLITS=num_splits, DOT_F32=_dot_f32(q.dtype),
        WINDOW=window or 0,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_rows, num_heads)](
            out, part_out, part_lse, query_index, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The kernels index K and V caches with one set of strides and a unit last stride.
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches must share strides and have a contiguous head_dim")


def _check_unit_stride(*tensors: torch.Tensor) -> None:
    # The kernels step the last dimension by 1 (e.g. row r of a [R] tensor at base + r): a
    # strided view would be read wrongly, silently. Shapes only, no device values read.
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"tensor of shape {tuple(t.shape)} needs a unit stride in its last dimension")


__all__ = [
    "PrefillRows",
    "decode_num_splits",
    "paged_decode",
    "prefill_attention",
    "write_kv",
]
