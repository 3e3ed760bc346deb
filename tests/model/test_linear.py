import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prelude.model.layers import linear
from prelude.kernels.cpu import native_lib
from prelude.model.layers.linear import ONEDNN_CACHE_BOUNDS, PACKED_MAX_ROWS, QuantPath, Projection, prepack_enabled


def _cpu_can_prepack_bf16() -> bool:
    """oneDNN's bf16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; AVX2-only CPUs lack it."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), None)
        return True
    except RuntimeError:
        return False


@pytest.fixture(autouse=True)
def without_tile_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests pin the oneDNN and MKL routes; on an AMX CPU bf16 calls of up to 32 rows
    take bf16_rows.c's tile form instead (its routing: test_bf16_rows.py), and up to
    its form's max_rows amx_gemm.c (test_amx_gemm.py), and on a CPU without AVX-512 float32
    calls take f32_gemm.c (test_f32_gemm.py)."""
    monkeypatch.setattr(linear, "tile_rows_kernel", lambda weight: None)
    monkeypatch.setattr(linear, "f32_gemm_kernel", lambda weight: None)
    monkeypatch.setattr(linear, "amx_gemm_kernel", lambda weight: None)


def test_projection_falls_back_to_plain_linear_where_prepack_is_unsupported() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    proj = Projection(w, None, prepack=True)
    assert torch.equal(proj(x), F.linear(x, w))
    assert (proj._packed is not None) == proj.packed == _cpu_can_prepack_bf16()  # packed on first use


@pytest.mark.skipif(not _cpu_can_prepack_bf16(), reason="this CPU cannot prepack bf16 weights (needs AVX-512)")
@pytest.mark.parametrize("rows", [0, 1, 4, 37])
def test_prepacked_bf16_projection_matches_plain_linear(rows: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    proj = Projection(w, b, prepack=True)
    out = proj(x)
    assert (proj._packed is not None) == (rows > 0)  # bf16: every row count takes the packed copy
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=0)
    # A 1-D input (one hidden row) agrees too.
    one = torch.randn(64, dtype=torch.bfloat16)
    torch.testing.assert_close(proj(one), F.linear(one, w, b))


@pytest.mark.skipif(not _cpu_can_prepack_bf16(), reason="this CPU cannot prepack bf16 weights (needs AVX-512)")
def test_bf16_calls_past_the_few_row_routes_run_the_packed_copy_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls up to the few-row routes' bound (GGUF blocks here, allowed 40 rows) keep them;
    longer bf16 calls run the packed copy on the caller's rows. Every shape of input agrees
    with F.linear: 2-D, rows at a stride, and a batch dimension."""
    torch.manual_seed(3)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16)
    to_blocks: list[int] = []
    to_packed: list[int] = []

    class Blocks:
        out_features, in_features = 96, 64

    class Kernel:
        def takes(self, dtype: torch.dtype) -> bool:
            return dtype == torch.bfloat16

        def linear(self, x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None) -> torch.Tensor:
            to_blocks.append(x.shape[0])
            return F.linear(x, w, bias)

    real = linear.packed_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        to_packed.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(linear, "packed_linear", recording)
    proj = Projection(w, b, prepack=True, blocks=QuantPath(Blocks(), Kernel()))  # type: ignore[arg-type]
    proj.limit_blocks(40)
    assert proj.make_packed_copy()
    x = torch.randn(100, 64, dtype=torch.bfloat16)
    for rows in (1, 40, 41, 100):
        torch.testing.assert_close(proj(x[:rows]), F.linear(x[:rows], w, b), rtol=0, atol=0)
    assert to_blocks == [1, 40] and to_packed == [41, 100]
    strided = torch.randn(50, 128, dtype=torch.bfloat16)[:, :64]
    torch.testing.assert_close(proj(strided), F.linear(strided, w, b), rtol=0, atol=0)
    batched = torch.randn(2, 25, 64, dtype=torch.bfloat16)
    out = proj(batched)
    assert out.shape == (2, 25, 96)
    torch.testing.assert_close(out, F.linear(batched, w, b), rtol=0, atol=0)
    proj.limit_blocks(0)  # no blocks: every call past the (absent) tile form's bound is direct
    to_packed.clear()
    proj(x[:3])
    assert to_packed == [3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_path_takes_bf16_at_every_row_count_and_float32_at_a_bounded_set(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """bf16: every row count takes the packed copy (F.linear is a oneDNN kernel per row count
    there too, 3-12% slower). float32: F.linear is MKL's, which compiles nothing per count,
    so the packed op sees only the decode sizes and the steps (2.2x MKL on an AMD AVX-512 CPU,
    1.2x in AVX2 code; off-step counts pad up to a step or run their whole steps there), a
    bounded set of kernels. Every count's result agrees."""
    if dtype == torch.bfloat16 and not _cpu_can_prepack_bf16():
        pytest.skip("this CPU cannot prepack bf16 weights (needs AVX-512)")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    torch.manual_seed(0)
    w = torch.randn(48, 32, dtype=dtype)
    proj = Projection(w, None, prepack=True)
    seen: set[int] = set()
    real = linear.packed_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.add(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(linear, "packed_linear", recording)
    x = torch.randn(linear.PACKED_STEP_MAX_ROWS + 300, 32, dtype=dtype)
    for rows in range(1, x.shape[0] + 1):
        out = proj(x[:rows])
        if rows in (1, 37, 128, 200, 256, linear.PACKED_STEP_MAX_ROWS, x.shape[0]):
            torch.testing.assert_close(out, F.linear(x[:rows], w))
    if dtype == torch.bfloat16:
        assert seen == set(range(1, x.shape[0] + 1))
        return
    steps = set(range(linear.PACKED_ROW_STEP, linear.PACKED_STEP_MAX_ROWS + 1, linear.PACKED_ROW_STEP))
    assert seen == set(range(1, PACKED_MAX_ROWS + 1)) | steps
    assert len(seen) <= 48  # a bounded set of kernels per weight shape


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_is_the_same_bits_at_every_decode_row_count(dtype: torch.dtype) -> None:
    """Up to PACKED_MAX_ROWS rows a row's output does not depend on the rows beside it (the
    packed kernel's; MKL's F.linear differs by row count and thread count), so identical
    requests batched differently answer identically. Small weights included: there
    F.linear is faster, and taking it broke this (docs/benchmarks.md, "Tried and not kept")."""
    if dtype == torch.bfloat16 and not _cpu_can_prepack_bf16():
        pytest.skip("this CPU cannot prepack bf16 weights (needs AVX-512)")
    torch.manual_seed(0)
    for out_features, in_features in ((96, 64), (256, 128)):
        proj = Projection(torch.randn(out_features, in_features, dtype=dtype), None, prepack=True)
        x = torch.randn(PACKED_MAX_ROWS, in_features, dtype=dtype)
        alone = proj(x[:1])[0]
        for rows in (2, 3, 5, 8, 16, PACKED_MAX_ROWS):
            assert torch.equal(proj(x[:rows])[0], alone), (out_features, in_features, rows)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("rows", [0, 1, 4, 37])
def test_prepacked_float32_projection_matches_plain_linear(rows: int) -> None:
    """oneDNN's float32 kernels sum in another order than MKL's: equal to fp32 rounding."""
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    b = torch.randn(96)
    x = torch.randn(rows, 64)
    proj = Projection(w, b, prepack=True)
    out = proj(x)
    assert proj.packed and (proj._packed is not None) == (0 < rows <= PACKED_MAX_ROWS)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    one = torch.randn(64)
    torch.testing.assert_close(proj(one), F.linear(one, w, b), rtol=1e-5, atol=1e-5)


def test_prepack_only_for_cpu_float32_and_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert prepack_enabled(torch.float32, cpu) == torch.backends.mkldnn.is_available()
    assert not prepack_enabled(torch.float16, cpu)
    assert not prepack_enabled(torch.bfloat16, torch.device("meta"))
    monkeypatch.setenv("PRELUDE_PREPACK", "0")
    assert not prepack_enabled(torch.bfloat16, cpu)
    assert not prepack_enabled(torch.float32, cpu)
    w = torch.randn(8, 4)
    x = torch.randn(3, 4)
    torch.testing.assert_close(Projection(w, None, prepack=False)(x), F.linear(x, w))


_GROWTH_PROBE = """
import os, torch
from prelude.model.layers.linear import Projection
proj = Projection(torch.randn(1536, 576), None, prepack=True)
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
proj(torch.randn(7, 576))
before = rss()
for rows in range(1, 400):
    proj(torch.randn(rows, 576))
print(rss() - before)
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not Path("/proc/self/statm").exists(),
                    reason="needs oneDNN and /proc")
def test_prepacked_projections_keep_memory_bounded_over_many_row_counts() -> None:
    """A new row count is a new oneDNN kernel with its own scratch memory: packing every
    call, 400 row counts grew this process by ~500 MiB (the soak's memory growth). Only
    decode-sized calls take the packed path, under bounded caches: a few tens of MiB."""
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_BOUNDS}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _GROWTH_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < 80.0, done.stdout


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_a_float32_step_makes_the_packed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """In float32 the packed kernels beat MKL's at step sizes: a process that only prefills
    128-token prompts takes them from its first step, and a 129-row call (its step up is
    past 1.6x of it) runs its whole step there and the one row after."""
    monkeypatch.setattr(linear, "PIECES_MIN_WEIGHT", 0)  # this small weight is cut like a model's
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    x = torch.randn(linear.PACKED_ROW_STEP + 1, 64)
    proj = Projection(w, None, prepack=True)
    seen: list[int] = []
    real = linear.packed_linear
    monkeypatch.setattr(linear, "packed_linear", lambda a, p, b: (seen.append(a.shape[0]), real(a, p, b))[1])
    torch.testing.assert_close(proj(x[:-1]), F.linear(x[:-1], w), rtol=1e-5, atol=1e-5)
    assert proj._packed is not None and seen == [linear.PACKED_ROW_STEP]
    seen.clear()
    torch.testing.assert_close(proj(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert seen == [linear.PACKED_ROW_STEP, 1]  # the step packed, then the one row after it


@pytest.mark.parametrize("flags, vendor, pads", [
    ({"avx2", "avx512_f"}, "AuthenticAMD", True),
    ({"avx2", "avx512_f"}, "GenuineIntel", False),  # MKL's AVX-512 code: padding would only waste rows
    ({"avx2", "avx512_f"}, "", False),  # vendor unknown: no padding
    ({"avx2"}, "AuthenticAMD", False),  # AVX2-only: steps, no padding (oneDNN 1.2x MKL at most)
])
def test_float32_row_counts_take_steps_and_pad_up_where_mkl_runs_avx2_code_on_avx512(
        monkeypatch: pytest.MonkeyPatch, flags: set[str], vendor: str, pads: bool) -> None:
    monkeypatch.setattr(native_lib, "cpu_isa_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native_lib, "cpu_vendor", lambda: vendor)
    linear._float32_pads.cache_clear()
    try:
        assert linear.packed_rows(17, torch.float32) == 17  # decode sizes as they are
        assert linear.packed_rows(960, torch.bfloat16) == 960  # bf16: every count as it is
        assert linear.packed_rows(1024, torch.float32) == 1024  # steps on every CPU
        assert linear.packed_rows(960, torch.float32) == (1024 if pads else 0)
        assert linear.packed_rows(1088, torch.float32) == (1152 if pads else 0)
        assert linear.packed_rows(80, torch.float32) == (128 if pads else 0)  # 1.6x the rows: still padded
        assert linear.packed_rows(79, torch.float32) == 0  # past 1.6x: MKL
        assert linear.packed_rows(129, torch.float32) == 0
        assert linear.packed_rows(2049, torch.float32) == 0  # a call cuts these into pieces first
        # pieces: 2,048 rows at a time, the rest's whole steps where the rest is not padded, then the rest
        assert linear.float32_pieces(2049) == [2048, 1]
        assert linear.float32_pieces(4396) == ([2048, 2048, 300] if pads else [2048, 2048, 256, 44])
        assert linear.float32_pieces(1088) == ([1088] if pads else [1024, 64])
        assert linear.float32_pieces(129) == [128, 1]  # 256 is past 1.6x of 129
    finally:
        linear._float32_pads.cache_clear()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_padded_float32_calls_agree_and_the_packed_kernel_sees_only_steps_with_zero_padding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where float32 pads (forced here, so any oneDNN CPU runs it): every count agrees with
    F.linear, the packed op sees the count's step with zero rows after the call's own, and
    a call past 2,048 rows goes 2,048 at a time."""
    monkeypatch.setattr(linear, "_float32_pads", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(linear, "PIECES_MIN_WEIGHT", 0)  # this small weight cuts long calls too
    torch.manual_seed(0)
    w, b = torch.randn(48, 32), torch.randn(48)
    proj = Projection(w, b, prepack=True)
    seen: list[torch.Tensor] = []
    real = linear.packed_linear
    monkeypatch.setattr(linear, "packed_linear", lambda a, p, bias: (seen.append(a.clone()), real(a, p, bias))[1])
    x = torch.randn(2 * linear.PACKED_STEP_MAX_ROWS + 300, 32)
    expected = {33: [], 80: [128], 200: [256], 960: [1024], 2048: [2048], x.shape[0]: [2048, 2048, 384]}
    for rows, counts in expected.items():
        seen.clear()
        out = proj(x[:rows])
        assert out.shape == (rows, 48)
        torch.testing.assert_close(out, F.linear(x[:rows], w, b), rtol=1e-5, atol=1e-5)
        assert [a.shape[0] for a in seen] == counts
        fed = torch.cat([a[: min(len(a), rows - i * linear.PACKED_STEP_MAX_ROWS)] for i, a in enumerate(seen)]) \
            if seen else x[:0]
        assert torch.equal(fed, x[:rows] if seen else x[:0])  # the call's rows, in order
        for i, a in enumerate(seen):
            own = min(len(a), rows - i * linear.PACKED_STEP_MAX_ROWS)
            assert not a[own:].any()  # the padding is zeros
    # a batch of rows in more dimensions pads as its flattened rows
    three = x[:200].reshape(2, 100, 32)
    torch.testing.assert_close(proj(three), F.linear(three, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_float32_calls_off_the_steps_run_their_whole_steps_packed_where_nothing_pads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where float32 does not pad (forced here): a call over a large enough weight runs its
    whole steps on the packed copy and the rest after (MKL past the decode sizes), in order,
    agreeing with F.linear; over a smaller weight the whole call is MKL's."""
    monkeypatch.setattr(linear, "_float32_pads", lambda dtype: False)
    torch.manual_seed(0)
    w, b = torch.randn(48, 32), torch.randn(48)
    proj = Projection(w, b, prepack=True)
    seen: list[int] = []
    real = linear.packed_linear
    monkeypatch.setattr(linear, "packed_linear", lambda a, p, bias: (seen.append(a.shape[0]), real(a, p, bias))[1])
    x = torch.randn(2 * linear.PACKED_STEP_MAX_ROWS + 300, 32)
    monkeypatch.setattr(linear, "PIECES_MIN_WEIGHT", w.numel() + 1)
    torch.testing.assert_close(proj(x[:1088]), F.linear(x[:1088], w, b), rtol=1e-5, atol=1e-5)
    assert seen == []  # a weight under the bound: MKL takes the whole call
    monkeypatch.setattr(linear, "PIECES_MIN_WEIGHT", w.numel())
    expected = {100: [], 130: [128, 2], 1088: [1024], 2048: [2048], x.shape[0]: [2048, 2048, 256]}
    for rows, counts in expected.items():
        seen.clear()
        torch.testing.assert_close(proj(x[:rows]), F.linear(x[:rows], w, b), rtol=1e-5, atol=1e-5)
        assert seen == counts


_BF16_GROWTH_PROBE = """
import torch
from prelude.model.layers.linear import Projection
import sys
proj = Projection(torch.randn(1536, 576, dtype=torch.bfloat16), None, prepack=sys.argv[1] == "packed")
x = torch.randn(3200, 576, dtype=torch.bfloat16)
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
proj(x)  # a larger step first, as a running server has seen: the kernels' scratch then counts in full
proj(x[:999])
before = rss()
for rows in range(1000, 1100):
    proj(x[:rows])
print(rss() - before)
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    or not Path("/proc/self/statm").exists(), reason="needs oneDNN's bf16 GEMM and /proc")
@pytest.mark.parametrize("path", ["plain", "packed"])
def test_bf16_prefill_sized_calls_keep_memory_bounded_over_many_row_counts(path: str) -> None:
    """bf16 calls go through oneDNN, packed or not, and its kernel for ~1,000 rows holds ~2.5
    MiB of scratch: 100 such row counts (prefill steps of an embeddings job) grew this
    process by ~300 MiB under oneDNN's default cache bounds (~60 MiB bounded). Building the
    projection bounds the caches before its first GEMM."""
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_BOUNDS}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _BF16_GROWTH_PROBE, path], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < 150.0, done.stdout
