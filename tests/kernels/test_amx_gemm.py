"""The bf16 prefill GEMM (amx_gemm.c: its AMX tile form, or its AVX512-BF16 dot-product form
where there is no AMX; each machine tests the form it runs) against float32 sums, and the
projections that take it."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from prelude.kernels.cpu import amx_gemm
from prelude.kernels.cpu import bf16_rows
from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.amx_gemm import load_amx_gemm
from prelude.kernels.cpu.bf16_rows import TILE_MAX_ROWS
from prelude.model.layers.linear import Projection

KERNEL = load_amx_gemm()
needs_amx = pytest.mark.skipif(KERNEL is None, reason="no AVX512-BF16 here (or no C compiler): bf16 prefills keep "
                                                      "oneDNN")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The float32 sums of the bf16 values, rounded once to bf16."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)


def assert_close_bf16(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    # a sum order apart: at most one bf16 rounding step of the larger values
    torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=2e-2)


@needs_amx
@pytest.mark.parametrize("out,k", [(32, 32), (96, 64), (576, 576), (64, 1536), (160, 320)])
@pytest.mark.parametrize("rows", [1, 15, 32, 33, 100, 128, 129, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_sums(out: int, k: int, rows: int, with_bias: bool) -> None:
    """k of one chunk, of whole slabs and of a slab and a part (1,536 = 5 slabs of 288 and
    96; 320 = one and 32), rows in one 32-row block and many, with a padded tail (15, 33,
    100, 129, 300) and past one 128-row chunk (129, 300), with and without bias."""
    torch.manual_seed(out * 1000 + k + rows)
    w = torch.randn(out, k).to(torch.bfloat16)
    b = torch.randn(out).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k).to(torch.bfloat16)
    assert KERNEL is not None
    assert_close_bf16(KERNEL.linear(x, KERNEL.pack(w), out, b), reference(x, w, b))


@needs_amx
def test_strided_rows_are_read_in_place() -> None:
    """Rows with a stride past k (a view of wider rows), the padded tail included."""
    torch.manual_seed(3)
    w = torch.randn(64, 64).to(torch.bfloat16)
    wide = torch.randn(70, 96).to(torch.bfloat16)
    x = wide[:, 8:72]
    assert x.stride(0) == 96
    assert KERNEL is not None
    assert_close_bf16(KERNEL.linear(x, KERNEL.pack(w), 64, None), reference(x, w, None))


@needs_amx
@pytest.mark.parametrize("rows", [1, 33, 100, 200])
def test_a_rows_answer_does_not_depend_on_the_other_rows_or_threads(rows: int) -> None:
    """A row's sums run in one order whatever block, chunk or tail it falls in and whatever
    the thread count: a prompt's rows answer the same in any batch the kernel takes."""
    torch.manual_seed(rows)
    w = torch.randn(1024, 576).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert KERNEL is not None
    packed = KERNEL.pack(w)
    team = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([KERNEL.linear(x[i:i + 1], packed, 1024, None) for i in range(rows)])
        torch.set_num_threads(max(2, team))
        together = KERNEL.linear(x, packed, 1024, None)
    finally:
        torch.set_num_threads(team)
    assert torch.equal(alone, together)


@needs_amx
def test_refuses_what_it_does_not_take() -> None:
    assert KERNEL is not None
    w = torch.randn(64, 64).to(torch.bfloat16)
    packed = KERNEL.pack(w)
    for bad in (torch.randn(48, 64), torch.randn(40, 64).to(torch.bfloat16), torch.randn(64, 48).to(torch.bfloat16)):
        assert not KERNEL.takes(bad)  # float32, 40 outputs, k of 48
        with pytest.raises(ValueError):
            KERNEL.pack(bad)
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(2, 64), packed, 64, None)  # float32 rows
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(2, 64).to(torch.bfloat16), packed, 32, None)  # not this copy's width
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(2, 64).to(torch.bfloat16), packed, 64, torch.randn(64))  # float32 bias
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(0, 64).to(torch.bfloat16), packed, 64, None)  # no rows


@needs_amx
def test_projection_takes_it_between_the_tile_form_and_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepacked bf16 projection runs the tile form up to TILE_MAX_ROWS rows (AMX), this
    kernel above (from one row without AMX: no few-row route here) up to its form's max_rows
    (2-D or with a batch dimension), oneDNN's packed copy past it; the copies are made at start;
    float32 and unpacked projections and an LM head never take it."""
    torch.manual_seed(5)
    w = torch.randn(96, 64).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    proj = Projection(w, b, prepack=True)
    assert proj.make_packed_copy() and proj.amx_copy() is not None
    assert proj._amx_packed is not None and proj._packed is not None
    calls: list[tuple[str, int]] = []
    gemm, rows_kernel = amx_gemm.AmxGemm.linear, bf16_rows.Bf16Rows.linear

    def counted_gemm(self, x, packed, out_features, bias):  # noqa: ANN001, ANN202
        calls.append(("amx", x.shape[0]))
        return gemm(self, x, packed, out_features, bias)

    def counted_rows(self, x, weight, bias, amx=True):  # noqa: ANN001, ANN202
        calls.append(("tile", x.reshape(-1, x.shape[-1]).shape[0]))
        return rows_kernel(self, x, weight, bias, amx)

    monkeypatch.setattr(amx_gemm.AmxGemm, "linear", counted_gemm)
    monkeypatch.setattr(bf16_rows.Bf16Rows, "linear", counted_rows)
    bound = KERNEL.max_rows  # type: ignore[union-attr]
    for rows in (1, TILE_MAX_ROWS, TILE_MAX_ROWS + 1, bound, bound + 1):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert_close_bf16(proj(x), reference(x, w, b))
    x3 = torch.randn(2, 30, 64).to(torch.bfloat16)
    assert_close_bf16(proj(x3), reference(x3, w, b))
    small = "tile" if proj.tile_form is not None else "amx"
    assert (proj.tile_form is not None) == (KERNEL is not None and KERNEL.form == "AMX")
    assert calls == [(small, 1), (small, TILE_MAX_ROWS), ("amx", TILE_MAX_ROWS + 1), ("amx", bound), ("amx", 60)]
    assert Projection(w, b, prepack=False)._amx is None
    assert Projection(w, b, prepack=True, head=True)._amx is None
    assert Projection(w.float(), b.float(), prepack=True)._amx is None
    assert Projection(torch.randn(80, 64).to(torch.bfloat16), None, prepack=True)._amx is None  # 80 outputs


@needs_amx
def test_switch_off_keeps_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRELUDE_AMX_GEMM", "0")
    load_amx_gemm.cache_clear()
    try:
        assert load_amx_gemm() is None
        assert Projection(torch.randn(32, 64).to(torch.bfloat16), None, prepack=True)._amx is None
    finally:
        monkeypatch.delenv("PRELUDE_AMX_GEMM")
        load_amx_gemm.cache_clear()


def test_avx2_build_is_not_ready_and_refuses_calls() -> None:
    """Built for an AVX2-only CPU the library loads, says it cannot run, and refuses a call
    (nothing runs an instruction such a CPU lacks)."""
    if native_lib.compiler() is None:
        pytest.skip("no C compiler")
    lib = ctypes.CDLL(str(amx_gemm.build(native_lib.AVX2_FLAGS)))
    lib.prelude_amx_gemm_ready.restype = ctypes.c_int
    assert lib.prelude_amx_gemm_ready() == 0
    fn = lib.prelude_amx_gemm
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    w = torch.zeros(512, dtype=torch.int32)
    y = torch.full((1, 32), 7.0, dtype=torch.bfloat16)
    assert fn(x.data_ptr(), 1, 32, w.data_ptr(), 32, 32, None, y.data_ptr(), 32, 1) == 1
    assert torch.equal(y, torch.full((1, 32), 7.0, dtype=torch.bfloat16))


@needs_amx
def test_the_dense_route_decode_routes_times_is_the_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    """linear.dense_linear (what decode_routes.py times against the GGUF blocks) runs what a
    projection runs past the blocks: the tile form where it takes the rows, amx_gemm.c over
    the copy up to its form's max_rows, oneDNN past it; the same values as the projection's call."""
    from prelude.model.layers import linear

    torch.manual_seed(9)
    w = torch.randn(96, 64).to(torch.bfloat16)
    proj = Projection(w, None, prepack=True)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    calls: list[int] = []
    gemm = amx_gemm.AmxGemm.linear

    def counted(self, x, packed, out_features, bias):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        return gemm(self, x, packed, out_features, bias)

    monkeypatch.setattr(amx_gemm.AmxGemm, "linear", counted)
    bound = KERNEL.max_rows  # type: ignore[union-attr]
    for rows in (1, 4, bound, bound + 1):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        got = linear.dense_linear(x, w, packed, proj.tile_form, None, KERNEL, proj.amx_copy())
        assert torch.equal(got, proj(x))
    tiled = TILE_MAX_ROWS if proj.tile_form is not None else 0
    # each count twice: dense_linear's call, then the projection's
    assert calls == [r for r in (1, 1, 4, 4, bound, bound) if r > tiled]
