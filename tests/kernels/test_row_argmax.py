"""The C row argmax gives torch.argmax's answer (first of equal maxima, NaN as the maximum),
and the C exponential race the torch expression's token."""

from __future__ import annotations

import pytest
import torch

from prelude.kernels.cpu import row_argmax as ra
from prelude.executor.sampler import uniform_noise

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
    probs, seeds, positions = x.softmax(-1), torch.tensor([1, 2, 3]), torch.tensor([0, 0, 4])
    assert torch.equal(ra.race_argmax(probs, seeds, positions, uniform_noise), _torch_race(probs, seeds, positions))


def _torch_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (probs / -torch.log(uniform_noise(seeds, positions, probs.shape[1])).to(probs.dtype)).argmax(-1)


@needs_kernel
def test_race_draws_the_torch_expressions_token() -> None:
    gen = torch.Generator().manual_seed(1)
    for width in (5, 300, 49152):
        for trial in range(12):
            probs = (torch.randn(4, width, generator=gen) * (0.5 + trial % 4)).softmax(-1)
            if trial % 3 == 1:  # a truncated support: zeros never win
                probs[:, torch.randint(width, (width // 2,), generator=gen)] = 0.0
            seeds = torch.randint(-2**62, 2**62, (4,), generator=gen)
            positions = torch.randint(0, 5000, (4,), generator=gen)
            assert torch.equal(ra.race_argmax(probs, seeds, positions, uniform_noise),
                               _torch_race(probs, seeds, positions))


@needs_kernel
def test_race_edge_rows_follow_argmax() -> None:
    seeds, positions = torch.tensor([3, 4]), torch.tensor([0, 9])
    zeros = torch.zeros(2, 64)  # nothing to draw: the first index, as argmax of zeros
    assert ra.race_argmax(zeros, seeds, positions, uniform_noise).tolist() == [0, 0]
    nan = torch.full((2, 64), 1 / 64)
    nan[:, 10] = float("nan")
    assert ra.race_argmax(nan, seeds, positions, uniform_noise).tolist() == [10, 10]
