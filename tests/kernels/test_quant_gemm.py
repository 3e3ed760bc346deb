"""GGUF block-format projections: repacking equals gguf's dequantization bit for bit, the
AVX2 kernel equals F.linear over those weights to float32 rounding, and a model built
with blocks decodes the same greedy tokens as one without."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from prelude.kernels.cpu.quant_gemm import load_kernel
from prelude.kernels.ggml_quants import GgmlQuants, load_blocks, save_blocks
from prelude.model.layers.linear import QUANT_MAX_ROWS, QuantPath, Projection

gguf = pytest.importorskip("gguf")

GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def quantized(gguf_type: str, rows: int, cols: int, seed: int = 0) -> tuple[GgmlQuants, torch.Tensor]:
    """Random weights quantized by gguf: our blocks and gguf's own float32 dequantization."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, gguf_type)
    raw = gguf.quants.quantize(w, qtype)
    ref = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
    blocks = GgmlQuants.from_gguf(gguf_type, raw, rows)
    assert blocks is not None
    return blocks, torch.from_numpy(ref)


@pytest.fixture(scope="module")
def kernel():  # noqa: ANN201
    k = load_kernel()
    if k is None:
        pytest.skip("the blocks kernel cannot run here (no C compiler or no AVX2+FMA)")
    return k


@pytest.mark.parametrize("gguf_type", GGUF_TYPES)
def test_repacked_blocks_dequantize_exactly_as_gguf(gguf_type: str) -> None:
    blocks, ref = quantized(gguf_type, 40, 96)
    assert blocks.kind == gguf_type.lower()
    assert (blocks.out_features, blocks.in_features) == (40, 96)
    assert torch.equal(blocks.dequantize(), ref)


def test_unknown_formats_are_not_kept() -> None:
    assert GgmlQuants.from_gguf("Q6_K", np.zeros((2, 210), dtype=np.uint8), 2) is None


def test_cat_and_select_rows_keep_rows_in_order() -> None:
    a, ra = quantized("Q4_1", 8, 64, seed=1)
    b, rb = quantized("Q4_1", 4, 64, seed=2)
    assert torch.equal(GgmlQuants.cat([a, b]).dequantize(), torch.cat([ra, rb]))  # type: ignore[union-attr]
    c, _ = quantized("Q8_0", 4, 64)
    assert GgmlQuants.cat([a, c]) is None and GgmlQuants.cat([a, None]) is None
    order = torch.tensor([3, 0, 2, 1])
    assert torch.equal(b.select_rows(order).dequantize(), rb[order])


def test_blocks_file_round_trips(tmp_path) -> None:  # noqa: ANN001
    q41, _ = quantized("Q4_1", 8, 64)
    q8, _ = quantized("Q8_0", 8, 64)
    save_blocks({"a.weight": q41, "b.weight": q8}, tmp_path / "blocks.bin")
    loaded = load_blocks(tmp_path / "blocks.bin")
    assert sorted(loaded) == ["a.weight", "b.weight"]
    assert torch.equal(loaded["a.weight"].dequantize(), q41.dequantize())
    assert loaded["b.weight"].kind == "q8_0" and loaded["b.weight"].m is None
    assert load_blocks(tmp_path / "missing.bin") == {}


@pytest.mark.parametrize("gguf_type", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13])
def test_kernel_equals_linear_over_the_same_weights(kernel, gguf_type: str, rows: int) -> None:  # noqa: ANN001
    blocks, ref = quantized(gguf_type, 72, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(72)
    torch.testing.assert_close(kernel.linear(x, blocks, bias), F.linear(x, ref, bias), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernel.linear(x.reshape(1, rows, 160), blocks), F.linear(x, ref).reshape(1, rows, 72),
                               rtol=1e-4, atol=1e-4)


def test_kernel_refuses_what_it_cannot_read(kernel) -> None:  # noqa: ANN001
    blocks, _ = quantized("Q4_1", 8, 64)
    with pytest.raises(ValueError):
        kernel.linear(torch.randn(2, 32), blocks)
    with pytest.raises(ValueError):
        kernel.linear(torch.randn(2, 64, dtype=torch.float64), blocks)
    assert kernel.linear(torch.randn(0, 64), blocks).shape == (0, 8)


def test_projection_reads_blocks_for_few_rows_only(kernel, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    blocks, ref = quantized("Q4_1", 48, 64)
    calls: list[int] = []
    real = kernel.linear

    def counting(x, b, bias=None):  # noqa: ANN001, ANN202
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, b, bias)

    monkeypatch.setattr(kernel, "linear", counting)
    proj = Projection(ref, None, prepack=False, blocks=QuantPath(blocks, kernel))
    for n in (1, QUANT_MAX_ROWS, QUANT_MAX_ROWS + 1, 64):
        x = torch.randn(n, 64)
        torch.testing.assert_close(proj(x), F.linear(x, ref), rtol=1e-4, atol=1e-4)
    assert calls == [1, QUANT_MAX_ROWS]
    with pytest.raises(ValueError):
        Projection(ref[:, :32].contiguous(), None, blocks=QuantPath(blocks, kernel))


def test_no_compiler_or_switched_off_means_no_kernel(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Decode then keeps reading float32: the model asks, gets None, builds no blocks path."""
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert load_kernel() is None
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PRELUDE_BLOCKS_KERNEL", "0")
    assert load_kernel() is None


def _bf16_kernel(kernel):  # noqa: ANN001, ANN202
    if not kernel.bf16:
        from prelude.kernels.cpu.native_lib import cpu_isa_flags

        pytest.skip("bf16 activations need AVX512-BF16; this CPU has "
                    + " ".join(sorted(f for f in cpu_isa_flags() if f.startswith(("avx", "amx")))))
    return kernel


@pytest.mark.parametrize("gguf_type", GGUF_TYPES)
@pytest.mark.parametrize("rows,k", [(1, 160), (2, 608), (3, 160), (4, 608), (5, 160), (9, 608)])
def test_bf16_kernel_equals_linear_over_the_same_weights(kernel, gguf_type: str, rows: int, k: int) -> None:  # noqa: ANN001
    """bf16 rows (odd block counts; more blocks than one 16-lane step of minimums) against
    float32 F.linear over the dequantized weights: the one rounding of the output to bf16."""
    kernel = _bf16_kernel(kernel)
    blocks, ref = quantized(gguf_type, 72, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(72).to(torch.bfloat16)
    got = kernel.linear(x, blocks, bias)
    want = F.linear(x.float(), ref, bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 72)
    torch.testing.assert_close(got.float(), want, rtol=2**-8 + 1e-5, atol=1e-3)
    assert (got != want.to(torch.bfloat16)).sum().item() <= max(1, got.numel() // 50)  # a sum-order tie, rarely
    with pytest.raises(ValueError, match="bias"):
        kernel.linear(x, blocks, bias.float())


def test_avx2_build_has_no_bf16_path() -> None:
    """Built for AVX2+FMA only (what an AVX2-only CPU gets), the library says it cannot take
    bf16 rows, and bf16 projections stay on their dense route."""
    import ctypes

    from prelude.kernels.cpu import quant_gemm
    from prelude.kernels.cpu import native_lib

    if load_kernel() is None:
        pytest.skip("the blocks kernel cannot run here (no C compiler or no AVX2+FMA)")
    avx2 = quant_gemm.QuantKernel(ctypes.CDLL(str(quant_gemm.build(native_lib.AVX2_FLAGS))))
    assert not avx2.bf16 and avx2.takes(torch.float32) and not avx2.takes(torch.bfloat16)
    blocks, ref = quantized("Q4_1", 8, 64)
    with pytest.raises(ValueError):
        avx2.linear(torch.randn(2, 64).to(torch.bfloat16), blocks)
    proj = Projection(ref.to(torch.bfloat16), None, blocks=QuantPath(blocks, avx2))
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert torch.equal(proj(x), F.linear(x, ref.to(torch.bfloat16)))


def test_limit_blocks_moves_the_row_cut(kernel) -> None:  # noqa: ANN001
    blocks, ref = quantized("Q8_0", 16, 64)
    proj = Projection(ref, None, blocks=QuantPath(blocks, kernel))
    proj.limit_blocks(2)
    assert proj.blocks is not None and proj.blocks.max_rows == 2
    x = torch.randn(3, 64)
    assert torch.equal(proj(x[:2]), kernel.linear(x[:2], blocks))
    assert torch.equal(proj(x), F.linear(x, ref))  # 3 rows: the dense route
    proj.limit_blocks(0)
    assert proj.blocks is None


def test_decode_route_crossover_and_cache(kernel, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from prelude.model.fast_paths import decode_routes

    assert decode_routes.crossover({1: (1.0, 2.0), 2: (1.5, 2.0), 4: (3.0, 2.1), 8: (1.0, 9.0)}) == 2
    assert decode_routes.crossover({1: (2.0, 1.0)}) == 0
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))
    pairs = [quantized("Q4_1", 64, 128, seed=s) for s in range(2)]
    pairs = [(ref, b) for b, ref in pairs]
    first = decode_routes.choose(pairs, kernel, torch.float32)
    assert first.source == "measured" and first.ms and first.blocks_max_rows == decode_routes.crossover(first.ms)
    again = decode_routes.choose(pairs, kernel, torch.float32)
    assert again.source == "cached" and again.blocks_max_rows == first.blocks_max_rows and again.ms == first.ms
    assert "decode GEMMs in float32" in again.describe(torch.float32)
