"""The C row argmax gives torch.argmax's answer: first of equal maxima, NaN as the maximum."""

from __future__ import annotations

import pytest
import torch

from prelude.executor import row_argmax as ra

needs_kernel = pytest.mark.skipif(ra._kernel() is None, reason="no C compiler or AVX2+FMA: torch.argmax serves")


def _cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out: list[torch.Tensor] = []
    for rows, width in [(1, 1), (3, 7), (4, 255), (4, 256), (4, 257), (5, 1000), (2, 49152)]:
        x = torch.randn(rows, width, generator=gen)
        out.append(x)
        out.append((x * 2).round())  # many ties, across block boundaries
        nan = x.clone()
        nan[:, torch.randint(width, (2,), generator=gen)] = float("nan")
        out.append(nan)
        out.append(torch.full((rows, width), float("-inf")))
        zeros = torch.zeros(rows, width)
        zeros[:, width // 2] = -0.0  # -0.0 == 0.0: the first zero wins
        out.append(zeros)
        late = torch.full((rows, width), -1.0)
        late[:, -1] = 5.0  # the maximum in the last (partial) block
        out.append(late)
    return out


@needs_kernel
@pytest.mark.parametrize("x", _cases(), ids=lambda x: f"{tuple(x.shape)}")
def test_matches_torch_argmax(x: torch.Tensor) -> None:
    assert torch.equal(ra.row_argmax(x), x.argmax(-1))


@needs_kernel
def test_strided_rows_and_other_inputs_match_torch() -> None:
    base = torch.randn(6, 300)
    rows = base[::2, :257]  # rows further apart than they are wide
    assert torch.equal(ra.row_argmax(rows), rows.argmax(-1))
    cols = base.t()[:5]  # a column stride: torch serves it
    assert torch.equal(ra.row_argmax(cols), cols.argmax(-1))
    half = base.to(torch.bfloat16)
    assert torch.equal(ra.row_argmax(half), half.argmax(-1))
    assert ra.row_argmax(torch.randn(0, 10)).shape == (0,)


def test_off_switch_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ra, "_kernel", lambda: None)
    x = torch.randn(3, 50)
    assert torch.equal(ra.row_argmax(x), x.argmax(-1))
