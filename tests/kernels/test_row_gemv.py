"""The few-row float32 GEMV (row_gemv.c: one row on the plain weight, 2-16 on a blocked
copy) and the projections that take it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prelude.model.layers import linear
from prelude.model.layers.linear import Projection
from prelude.kernels.cpu.row_gemv import BLOCKED_MAX_ROWS, ROW_GEMV_MIN_BYTES, RowGemv, load_row_gemv

KERNEL = load_row_gemv()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX-512 or no C compiler: projections keep oneDNN")


@needs_kernel
@pytest.mark.parametrize("k", [16, 48, 64, 128, 256, 320])
@pytest.mark.parametrize("out", [1, 7, 4099])
@pytest.mark.parametrize("with_bias", [False, True])
def test_row_gemv_matches_linear(k: int, out: int, with_bias: bool) -> None:
    torch.manual_seed(k + out)
    w = torch.randn(out, k)
    b = torch.randn(out) if with_bias else None
    x = torch.randn(1, k)
    assert KERNEL is not None
    y = KERNEL.linear(x, w, b)
    assert y.shape == (1, out) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    one = KERNEL.linear(x[0], w, b)  # a 1-D row answers 1-D
    assert one.shape == (out,) and torch.equal(one, y[0])


@needs_kernel
def test_row_gemv_reads_an_unaligned_weight_and_row() -> None:
    """A checkpoint's tensor may start anywhere in its file's mapping (the free model's
    embedding starts 32 bytes into a cache line)."""
    torch.manual_seed(0)
    store = torch.randn(5000 * 128 + 8)
    w = store[8:].view(5000, 128)
    x = torch.randn(1, 129)[:, 1:]
    assert w.data_ptr() % 64 and x.data_ptr() % 64
    assert KERNEL is not None
    torch.testing.assert_close(KERNEL.linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_row_gemv_answer_does_not_depend_on_the_thread_count() -> None:
    torch.manual_seed(1)
    w = torch.randn(10_001, 128)
    x = torch.randn(1, 128)
    team = torch.get_num_threads()
    assert KERNEL is not None
    try:
        torch.set_num_threads(1)
        one = KERNEL.linear(x, w, None)
        torch.set_num_threads(max(2, team))
        many = KERNEL.linear(x, w, None)
    finally:
        torch.set_num_threads(team)
    assert torch.equal(one, many)


def test_row_gemv_takes_wide_contiguous_float32_weights_only() -> None:
    rows = ROW_GEMV_MIN_BYTES // (4 * 128)
    assert RowGemv.takes(torch.zeros(rows, 128))
    assert not RowGemv.takes(torch.zeros(rows - 1, 128))  # small: oneDNN keeps it
    assert not RowGemv.takes(torch.zeros(rows, 128, dtype=torch.bfloat16))
    assert not RowGemv.takes(torch.zeros(rows * 2, 120))  # k not a multiple of 16
    assert not RowGemv.takes(torch.zeros(128, rows).t())  # not contiguous


@needs_kernel
@pytest.mark.parametrize("rows", range(2, BLOCKED_MAX_ROWS + 1))
@pytest.mark.parametrize("k,out", [(128, 4099), (48, 7), (320, 33)])
def test_blocked_rows_match_linear(rows: int, k: int, out: int) -> None:
    torch.manual_seed(rows * k + out)
    w = torch.randn(out, k)
    b = torch.randn(out)
    x = torch.randn(rows, k)
    assert KERNEL is not None
    blocked = KERNEL.block(w)
    assert blocked.shape == ((out + 15) // 16, k, 16)
    # equal to fp32 rounding: sums of k products of N(0, 1) values, another order than MKL's
    torch.testing.assert_close(KERNEL.rows_linear(x, blocked, out, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(KERNEL.rows_linear(x, blocked, out, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    three_d = x.view(1, rows, k)  # leading dimensions kept
    assert KERNEL.rows_linear(three_d, blocked, out, None).shape == (1, rows, out)


@needs_kernel
def test_blocked_answer_does_not_depend_on_the_thread_count() -> None:
    torch.manual_seed(3)
    w = torch.randn(10_001, 128)
    x = torch.randn(BLOCKED_MAX_ROWS, 128)
    assert KERNEL is not None
    blocked = KERNEL.block(w)
    team = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.rows_linear(x, blocked, 10_001, None)
        torch.set_num_threads(max(2, team))
        many = KERNEL.rows_linear(x, blocked, 10_001, None)
    finally:
        torch.set_num_threads(team)
    assert torch.equal(one, many)


@needs_kernel
def test_blocked_rows_refuse_what_they_do_not_take() -> None:
    w = torch.randn(64, 32)
    assert KERNEL is not None
    blocked = KERNEL.block(w)
    for bad in (torch.randn(1, 32), torch.randn(BLOCKED_MAX_ROWS + 1, 32), torch.randn(4, 32, dtype=torch.bfloat16)):
        with pytest.raises(ValueError):
            KERNEL.rows_linear(bad, blocked, 64, None)


@needs_kernel
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_projection_sends_few_row_float32_calls_of_a_wide_weight_to_the_row_gemv(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    w = torch.randn(ROW_GEMV_MIN_BYTES // (4 * 128), 128)
    head = Projection(w, None, prepack=True, head=True)
    packed_rows: list[int] = []
    real = linear.packed_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed_rows.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(linear, "packed_linear", recording)
    x = torch.randn(BLOCKED_MAX_ROWS + 1, 128)
    torch.testing.assert_close(head(x[:1]), F.linear(x[:1], w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head(x[0]), F.linear(x[0], w), rtol=1e-5, atol=1e-5)
    assert head._blocked is None  # one row reads the plain weight: no copy yet
    torch.testing.assert_close(head(x[:3]), F.linear(x[:3], w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head(x[:BLOCKED_MAX_ROWS]), F.linear(x[:BLOCKED_MAX_ROWS], w), rtol=1e-5, atol=1e-5)
    assert head._blocked is not None and packed_rows == []  # up to 16 rows: the row GEMV
    torch.testing.assert_close(head(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert packed_rows == []  # 17..64 rows: 16 at a time
    many = torch.randn(128, 128)
    torch.testing.assert_close(head(many), F.linear(many, w), rtol=1e-4, atol=1e-4)
    assert packed_rows == [128]  # more rows: oneDNN's packed copy, as before
    small = Projection(w[:64], None, prepack=True, head=True)
    small(x[:1])
    small(x[:3])
    assert packed_rows == [128, 1, 3]  # a small weight keeps oneDNN
    assert Projection(w, None, prepack=False, head=True)._row_gemv is None  # no prepacking (e.g. not a CPU)
    assert Projection(w, None, prepack=True)._row_gemv is None  # a decoder's projection: oneDNN, no blocked copy
    wide = torch.randn(ROW_GEMV_MIN_BYTES // (4 * 576) + 1, 576)  # SmolLM2's width: one row is oneDNN's
    head576 = Projection(wide, None, prepack=True, head=True)
    y = torch.randn(3, 576)
    torch.testing.assert_close(head576(y[:1]), F.linear(y[:1], wide), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(head576(y), F.linear(y, wide), rtol=1e-5, atol=1e-4)
    assert packed_rows == [128, 1, 3, 1]  # 1 row: oneDNN; 3 rows: the blocked copy
