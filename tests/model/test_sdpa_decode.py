import pytest
import torch

from prelude.model.attention.metadata import DecodeRows
from prelude.model.attention.sdpa_decode import decode_attention


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: list[int], length: int,
               scale: float) -> torch.Tensor:
    """One row, by the book: its tokens in table order, K/V repeated per query group."""
    bs = k_cache.shape[1]
    k = torch.cat([k_cache[b] for b in table])[:length]  # [L, Hkv, D]
    v = torch.cat([v_cache[b] for b in table])[:length]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, Hq, D]
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * scale, -1)
    assert len(table) * bs >= length
    return torch.einsum("hl,lhd->hd", probs, v)


@pytest.mark.parametrize("lengths", [[37], [1, 16, 17, 50, 33], [64, 64]])
def test_paged_gqa_decode_matches_per_row_reference(lengths: list[int]) -> None:
    torch.manual_seed(len(lengths))
    bs, hq, hkv, d, nblocks = 16, 6, 2, 32, 40
    k_cache, v_cache = torch.randn(nblocks, bs, hkv, d), torch.randn(nblocks, bs, hkv, d)
    perm = torch.randperm(nblocks).tolist()
    width = max((n + bs - 1) // bs for n in lengths)
    tables = [perm[i * width : i * width + (n + bs - 1) // bs] for i, n in enumerate(lengths)]
    # Decode rows sit among other tokens of the batch: query_index picks them out.
    q = torch.randn(len(lengths) + 3, hq, d)
    index = torch.tensor([2 + i for i in range(len(lengths))])
    rows = DecodeRows(index, torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lengths),
                      max(lengths))
    out = decode_attention(q, rows, k_cache, v_cache, d**-0.5)
    assert out.shape == (len(lengths), hq, d)
    for i, (t, n) in enumerate(zip(tables, lengths)):
        torch.testing.assert_close(out[i], _reference(q[2 + i], k_cache, v_cache, t, n, d**-0.5), rtol=1e-5, atol=1e-5)
