"""GGUF block-format projections: repacking equals gguf's dequantization bit for bit, the
AVX2 kernel equals F.linear over those weights to float32 rounding, and a model built
with blocks decodes the same greedy tokens as one without."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from prelude.model.blocks_kernel import load_kernel
from prelude.model.ggml_blocks import GgmlBlocks, load_blocks, save_blocks
from prelude.model.linear import BLOCKS_MAX_ROWS, BlocksPath, Projection

gguf = pytest.importorskip("gguf")

GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def quantized(gguf_type: str, rows: int, cols: int, seed: int = 0) -> tuple[GgmlBlocks, torch.Tensor]:
    """Random weights quantized by gguf: our blocks and gguf's own float32 dequantization."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, gguf_type)
    raw = gguf.quants.quantize(w, qtype)
    ref = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
    blocks = GgmlBlocks.from_gguf(gguf_type, raw, rows)
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
    assert GgmlBlocks.from_gguf("Q6_K", np.zeros((2, 210), dtype=np.uint8), 2) is None


def test_cat_and_select_rows_keep_rows_in_order() -> None:
    a, ra = quantized("Q4_1", 8, 64, seed=1)
    b, rb = quantized("Q4_1", 4, 64, seed=2)
    assert torch.equal(GgmlBlocks.cat([a, b]).dequantize(), torch.cat([ra, rb]))  # type: ignore[union-attr]
    c, _ = quantized("Q8_0", 4, 64)
    assert GgmlBlocks.cat([a, c]) is None and GgmlBlocks.cat([a, None]) is None
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
    proj = Projection(ref, None, prepack=False, blocks=BlocksPath(blocks, kernel))
    for n in (1, BLOCKS_MAX_ROWS, BLOCKS_MAX_ROWS + 1, 64):
        x = torch.randn(n, 64)
        torch.testing.assert_close(proj(x), F.linear(x, ref), rtol=1e-4, atol=1e-4)
    assert calls == [1, BLOCKS_MAX_ROWS]
    with pytest.raises(ValueError):
        Projection(ref[:, :32].contiguous(), None, blocks=BlocksPath(blocks, kernel))


def test_no_compiler_or_switched_off_means_no_kernel(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Decode then keeps reading float32: the model asks, gets None, builds no blocks path."""
    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert load_kernel() is None
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PRELUDE_BLOCKS_KERNEL", "0")
    assert load_kernel() is None
