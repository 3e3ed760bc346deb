"""The few-row bf16 GEMM (bf16_rows.c: the tile form on AMX, the vector form for the
outputs past the last whole block and without AMX) and the projections that take it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prelude.kernels.cpu import bf16_rows
from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.bf16_rows import TILE_MAX_ROWS, load_bf16_rows
from prelude.model.layers.linear import Projection, dense_linear

KERNEL = load_bf16_rows()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX512-BF16 or no C compiler: bf16 projections keep oneDNN")
needs_tiles = pytest.mark.skipif(KERNEL is None or not KERNEL.tile_form_ready(),
                                 reason="no AMX-BF16 here (or the OS refused the tile registers): the tile form "
                                        "cannot run")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The float32 sums of the bf16 values, rounded once to bf16: what the kernel computes, up
    to the order of its sums."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)


def assert_close_bf16(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    # a sum order apart: at most one bf16 rounding step of the larger values
    torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("out,k", [(1, 32), (7, 64), (16, 96), (100, 576), (130, 64), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40, 64, 65, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_sums(amx: bool, out: int, k: int, rows: int, with_bias: bool) -> None:
    """Output counts off the 16-output block (the vector form's tail), k of one and many
    32-wide chunks, rows in one to seven 16-row groups (one pass of the tile form over a
    block holds four, so 65 and 100 take two), with and without bias; both forms (the tile
    form where AMX is here, else the call falls to the vector form, which is then what is
    checked)."""
    torch.manual_seed(out * 1000 + k + rows)
    w = torch.randn(out, k).to(torch.bfloat16)
    b = torch.randn(out).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k).to(torch.bfloat16)
    assert KERNEL is not None
    assert_close_bf16(KERNEL.linear(x, w, b, amx=amx), reference(x, w, b))


@needs_kernel
@pytest.mark.parametrize("k", [2, 30, 33, 100])
def test_k_off_the_tile_chunk_runs_the_vector_form(k: int) -> None:
    """k not a multiple of 32 (odd k too): the tile form declines, the vector form's masked
    tail sums the rest; and no projection routes such a weight to the tile form."""
    torch.manual_seed(k)
    w = torch.randn(40, k).to(torch.bfloat16)
    x = torch.randn(3, k).to(torch.bfloat16)
    assert KERNEL is not None
    assert_close_bf16(KERNEL.linear(x, w, None), reference(x, w, None))
    assert not KERNEL.tile_form_takes(w)


@needs_kernel
@pytest.mark.parametrize("amx", [True, False])
def test_strided_rows_and_a_batch_dimension(amx: bool) -> None:
    """Rows with a stride past k (a view of wider rows) and a leading batch dimension are
    read in place and answered in their shape."""
    torch.manual_seed(3)
    w = torch.randn(48, 64).to(torch.bfloat16)
    wide = torch.randn(40, 96).to(torch.bfloat16)
    x = wide[:, 8:72]
    assert x.stride(0) == 96
    assert KERNEL is not None
    assert_close_bf16(KERNEL.linear(x, w, None, amx=amx), reference(x, w, None))
    x3 = torch.randn(2, 8, 64).to(torch.bfloat16)
    y3 = KERNEL.linear(x3, w, None, amx=amx)
    assert y3.shape == (2, 8, 48)
    assert_close_bf16(y3, reference(x3, w, None))


@needs_kernel
def test_refuses_what_it_does_not_take() -> None:
    assert KERNEL is not None
    w = torch.randn(16, 32).to(torch.bfloat16)
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(2, 32), w, None)  # float32 rows
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(257, 32).to(torch.bfloat16), w, None)  # past the C side's bound
    with pytest.raises(ValueError):
        KERNEL.linear(torch.randn(2, 32).to(torch.bfloat16), w, torch.randn(16))  # float32 bias
    assert not KERNEL.takes(torch.randn(16, 32))


@needs_tiles
@pytest.mark.parametrize("rows", [1, 4, 16, 40, 80])
def test_tile_form_row_answers_do_not_depend_on_the_row_count_or_threads(rows: int) -> None:
    """A row's sums run in a fixed order whatever else is in the call (whichever 16-row
    group and pass it falls in) and whatever the thread count: a decode row answers the
    same in any batch the tile form takes."""
    torch.manual_seed(rows)
    w = torch.randn(1000, 576).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert KERNEL is not None
    team = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([KERNEL.linear(x[i:i + 1], w, None) for i in range(rows)])
        torch.set_num_threads(max(2, team))
        together = KERNEL.linear(x, w, None)
    finally:
        torch.set_num_threads(team)
    assert torch.equal(alone, together)


@needs_tiles
def test_projection_takes_the_tile_form_up_to_its_row_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepacked bf16 projection runs the tile form for 1..TILE_MAX_ROWS rows and oneDNN's
    packed copy above; float32 projections and projections that are not prepacked never
    take it."""
    torch.manual_seed(5)
    w = torch.randn(80, 64).to(torch.bfloat16)
    b = torch.randn(80).to(torch.bfloat16)
    proj = Projection(w, b, prepack=True)
    assert proj.make_packed_copy()
    calls: list[int] = []
    original = bf16_rows.Bf16Rows.linear

    def counted(self, x, weight, bias, amx=True):  # noqa: ANN001, ANN202
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return original(self, x, weight, bias, amx)

    monkeypatch.setattr(bf16_rows.Bf16Rows, "linear", counted)
    for rows in (1, 7, TILE_MAX_ROWS, TILE_MAX_ROWS + 1, 3 * TILE_MAX_ROWS):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert_close_bf16(proj(x), reference(x, w, b))
    assert calls == [1, 7, TILE_MAX_ROWS]
    assert Projection(w, b, prepack=False)._bf16_rows is None
    assert Projection(w.float(), b.float(), prepack=True)._bf16_rows is None
    # decode_routes times the dense route through the same choice
    calls.clear()
    dense_linear(torch.randn(3, 64).to(torch.bfloat16), w, proj._packed_weight(), proj._bf16_rows)
    assert calls == [3]


@needs_kernel
def test_switch_off_keeps_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRELUDE_BF16_ROWS", "0")
    load_bf16_rows.cache_clear()
    try:
        assert load_bf16_rows() is None
        assert Projection(torch.randn(32, 64).to(torch.bfloat16), None, prepack=True)._bf16_rows is None
    finally:
        monkeypatch.delenv("PRELUDE_BF16_ROWS")
        load_bf16_rows.cache_clear()


def test_avx2_build_has_neither_form() -> None:
    """Built for an AVX2-only CPU the library loads and says it has neither form (nothing
    runs an instruction such a CPU lacks); a call is refused, not run."""
    if native_lib.compiler() is None:
        pytest.skip("no C compiler")
    lib = ctypes.CDLL(str(bf16_rows.build(native_lib.AVX2_FLAGS)))
    lib.prelude_bf16_rows_available.restype = ctypes.c_int
    lib.prelude_bf16_rows_amx_ready.restype = ctypes.c_int
    assert lib.prelude_bf16_rows_available() == 0
    assert lib.prelude_bf16_rows_amx_ready() == 0
    fn = lib.prelude_bf16_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    w = torch.zeros(16, 32, dtype=torch.bfloat16)
    y = torch.full((1, 16), 7.0, dtype=torch.bfloat16)
    assert fn(x.data_ptr(), 1, 32, w.data_ptr(), 16, 32, None, y.data_ptr(), 1, 1) == 1
    assert torch.equal(y, torch.full((1, 16), 7.0, dtype=torch.bfloat16))


def test_a_local_header_is_part_of_the_librarys_key(tmp_path) -> None:  # noqa: ANN001
    """The C files share native_shared.h: an edit to a header they include must build them
    anew, not load a library built from the old header."""
    cc = native_lib.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "shared.h").write_text("static inline int answer(void) { return 1; }\n")
    source = tmp_path / "user.c"
    source.write_text('#include "shared.h"\nint value(void) { return answer(); }\n')
    first = native_lib.library_path(source, cc)
    assert "return 1" in native_lib.source_text(source)
    (tmp_path / "shared.h").write_text("static inline int answer(void) { return 2; }\n")
    assert native_lib.library_path(source, cc) != first
    # the real sources: each includer's text carries the header
    header = (Path(bf16_rows.__file__).parent / "native_shared.h").read_text()
    for name in ("bf16_rows.c", "row_gemv.c", "cpu_attention.c", "amx_gemm.c"):
        assert header in native_lib.source_text(Path(bf16_rows.__file__).parent / name)
