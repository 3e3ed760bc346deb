"""The near-tie check the CUDA graph-vs-eager test uses: it passes equal runs and a flip
between near-tied top tokens, and fails a real difference."""

from __future__ import annotations

import pytest

from prelude.params import TokenLogprob
from tests.engine.near_ties import first_difference


def _lp(token: int, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
    return TokenLogprob(token, dict(top)[token], top)


def test_equal_runs_have_no_difference() -> None:
    run = [_lp(5, ((5, -0.1), (7, -2.0))), _lp(9, ((9, -0.3), (1, -1.5)))]
    assert first_difference(run, list(run), tol=0.05) is None


def test_a_near_tie_flip_is_allowed_and_located() -> None:
    want = [_lp(5, ((5, -0.1), (7, -2.0))), _lp(9, ((9, -0.69), (1, -0.71))), _lp(3, ((3, -0.2), (4, -3.0)))]
    got = [want[0], _lp(1, ((1, -0.69), (9, -0.70))), _lp(8, ((8, -0.1), (2, -2.0)))]  # parts after the flip
    assert first_difference(want, got, tol=0.05) == 1


@pytest.mark.parametrize("got_token, got_top", [
    (1, ((1, -0.2), (9, -1.9))),  # a clear second choice
    (4, ((4, -0.3), (9, -0.31))),  # not among the first run's alternatives at all
])
def test_a_real_difference_fails(got_token: int, got_top: tuple[tuple[int, float], ...]) -> None:
    want = [_lp(9, ((9, -0.3), (1, -1.9)))]
    with pytest.raises(AssertionError):
        first_difference(want, [_lp(got_token, got_top)], tol=0.05)
