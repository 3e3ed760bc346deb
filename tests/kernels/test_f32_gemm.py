"""The float32 prefill GEMM for CPUs without AVX-512 (f32_gemm.c, AVX2 + FMA) against
float64 sums, and the projections that take it. The kernel is built for an AVX2-only CPU
here (without the host's wider paths), so any AVX2 machine runs these tests."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from prelude.kernels.cpu import f32_gemm
from prelude.model.layers import linear
from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.f32_gemm import F32Gemm, load_f32_gemm
from prelude.model.layers.linear import Projection


def _avx2_kernel() -> F32Gemm | None:
    if native_lib.compiler() is None or not native_lib.cpu_has_avx2_fma():
        return None
    return F32Gemm(ctypes.CDLL(str(f32_gemm.build(native_lib.AVX2_FLAGS))))


KERNEL = _avx2_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler or no AVX2+FMA: float32 keeps oneDNN")


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of the F32Gemm.linear calls from now on (the kernel still runs them)."""
    calls: list[int] = []
    run = F32Gemm.linear

    def counted(self, x, packed, out_features, bias):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        return run(self, x, packed, out_features, bias)

    monkeypatch.setattr(F32Gemm, "linear", counted)
    return calls


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@needs_kernel
@pytest.mark.parametrize("out,k", [(8, 1), (16, 7), (24, 64), (40, 100), (72, 576), (576, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 33, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_sums(out: int, k: int, rows: int, with_bias: bool) -> None:
    """Groups of 1, 2 and 3 blocks of 8 outputs (8, 16, 24, 40 = 3 + 2, 72 = 3 x 3), row
    blocks of 1-4 rows and their tails, k of one and more, with and without a bias."""
    torch.manual_seed(out * 1000 + k + rows)
    w, x = torch.randn(out, k), torch.randn(rows, k)
    b = torch.randn(out) if with_bias else None
    y = KERNEL.linear(x, KERNEL.pack(w), out, b)  # type: ignore[union-attr]
    torch.testing.assert_close(y, reference(x, w, b), rtol=1e-5, atol=1e-4 * max(1.0, k ** 0.5))


@needs_kernel
def test_strided_rows_and_a_row_whatever_shares_its_call() -> None:
    """x rows with a stride past k (a slice of wider rows), and a row's bits the same at every
    row count and thread count (threads split the outputs, k runs in order)."""
    torch.manual_seed(3)
    w, wide = torch.randn(96, 64), torch.randn(300, 80)
    x = wide[:, :64]
    packed = KERNEL.pack(w)  # type: ignore[union-attr]
    assert x.stride(0) == 80
    torch.testing.assert_close(KERNEL.linear(x, packed, 96, None), reference(x, w, None), rtol=1e-5,  # type: ignore[union-attr]
                               atol=1e-4)
    threads = torch.get_num_threads()
    firsts = []
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            firsts += [KERNEL.linear(x[:rows].contiguous(), packed, 96, None)[0] for rows in (1, 3, 4, 5, 64, 300)]  # type: ignore[union-attr]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(f, firsts[0]) for f in firsts)


@needs_kernel
def test_refuses_what_it_cannot_run() -> None:
    packed = KERNEL.pack(torch.randn(16, 8))  # type: ignore[union-attr]
    assert not F32Gemm.takes(torch.randn(12, 8))  # 12 outputs: not whole blocks of 8
    assert not F32Gemm.takes(torch.randn(16, 8).to(torch.bfloat16))
    with pytest.raises(ValueError):
        KERNEL.pack(torch.randn(12, 8))  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(2, 8), packed, 8, None)  # not this copy's width
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(2, 8).double(), packed, 16, None)
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(0, 8), packed, 16, None)  # no rows
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(2, 8), packed, 16, torch.randn(16).double())


def test_serves_only_cpus_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has AVX-512, oneDNN's float32 kernels keep every call; under the AVX2 cap
    (an AVX2-only CPU, emulated) the kernel loads."""
    load_f32_gemm.cache_clear()
    try:
        if "avx512_f" in native_lib.cpu_isa_flags():
            assert load_f32_gemm() is None
        monkeypatch.setenv(native_lib.ISA_CAP_ENV, "avx2")
        load_f32_gemm.cache_clear()
        if KERNEL is not None:
            assert load_f32_gemm() is not None
        monkeypatch.setenv("PRELUDE_F32_GEMM", "0")
        load_f32_gemm.cache_clear()
        assert load_f32_gemm() is None
    finally:
        monkeypatch.delenv("PRELUDE_F32_GEMM", raising=False)
        monkeypatch.delenv(native_lib.ISA_CAP_ENV, raising=False)
        load_f32_gemm.cache_clear()


@needs_kernel
def test_projection_takes_it_past_the_few_row_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepacked float32 projection on such a CPU runs it for calls up to max_rows (2-D or
    with a batch dimension), the other routes past it; an LM head and a bf16 weight never
    take it, the batch-invariant one route keeps it (test_batch_invariant.py: at every row
    count); decode_routes' dense route is the same call."""
    monkeypatch.setattr(linear, "load_f32_gemm", lambda: KERNEL)
    torch.manual_seed(7)
    w, b = torch.randn(48, 64), torch.randn(48)
    proj = Projection(w, b, prepack=True)
    assert proj.f32_gemm is KERNEL and proj.gemm_copy() is not None
    calls = count_calls(monkeypatch)
    bound = KERNEL.max_rows  # type: ignore[union-attr]
    for rows in (1, 5, bound, bound + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(proj(x), reference(x, w, b), rtol=1e-4, atol=1e-4)
    x3 = torch.randn(2, 30, 64)
    torch.testing.assert_close(proj(x3), reference(x3, w, b), rtol=1e-4, atol=1e-4)
    assert calls == [1, 5, bound, 60]
    x = torch.randn(6, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    assert torch.equal(linear.dense_linear(x, w, packed, None, b, KERNEL, proj.gemm_copy()), proj(x))
    assert Projection(w, b, prepack=True, head=True).f32_gemm is None
    assert Projection(w, b, prepack=False).f32_gemm is None
    assert Projection(w.to(torch.bfloat16), None, prepack=True).f32_gemm is None
    assert proj.take_one_route() and proj.f32_gemm is KERNEL
