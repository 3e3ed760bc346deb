"""The encoders' attention (model/attention/bidirectional.py) against a plain per-row softmax:
rows of several lengths padded together, grouped-query heads, the whole row or a window
of `window // 2` positions on either side, rows long enough to run in query chunks."""

from __future__ import annotations

import pytest
import torch

from prelude.model.attention.bidirectional import BidirectionalAttention
from prelude.model.attention.metadata import AttentionMetadata, PrefillSlice


def _meta(lengths: list[int]) -> AttentionMetadata:
    slices, at = [], 0
    for n in lengths:
        slices.append(PrefillSlice(at, n, n, torch.empty(0, dtype=torch.long), own_kv_in_cache=False))
        at += n
    return AttentionMetadata(None, tuple(slices), None, 16)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float,
               radius: int | None) -> torch.Tensor:
    out, at = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qr = q[at:at + n].double().transpose(0, 1)  # [H, n, D]
        kr = k[at:at + n].double().repeat_interleave(group, dim=1).transpose(0, 1)
        vr = v[at:at + n].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qr @ kr.transpose(1, 2) * scale
        if radius is not None:
            pos = torch.arange(n)
            scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() > radius, float("-inf"))
        out.append((scores.softmax(-1) @ vr).transpose(0, 1))
        at += n
    return torch.cat(out).float()


@pytest.mark.parametrize("window", [None, 6, 40, 1000])
@pytest.mark.parametrize("lengths", [[150, 37, 1, 200], [160, 160], [9]])
def test_rows_equal_a_per_row_softmax(window: int | None, lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(lengths) * 100 + (window or 0))
    total = sum(lengths)
    q = torch.randn(total, 4, 16, generator=gen)
    k = torch.randn(total, 2, 16, generator=gen)
    v = torch.randn(total, 2, 16, generator=gen)
    got = BidirectionalAttention().forward(q, k, v, torch.empty(0), torch.empty(0), _meta(lengths), 0.3, window)
    want = _reference(q, k, v, lengths, 0.3, None if window is None else window // 2)
    assert got.shape == q.shape
    assert (got - want).abs().max().item() <= 1e-5


def test_a_cached_prefix_or_a_decode_row_is_refused() -> None:
    meta = AttentionMetadata(None, (PrefillSlice(0, 4, 8, torch.zeros(2, dtype=torch.long)),), None, 4)
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="whole prompts"):
        BidirectionalAttention().forward(q, q, q, torch.empty(0), torch.empty(0), meta, 1.0)
