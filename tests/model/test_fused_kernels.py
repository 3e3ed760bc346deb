"""The fused Triton kernels (model/fused_kernels.py) and the segments built on them vs the
eager segments, on the CPU under TRITON_INTERPRET=1 (tests/model/triton_interp.py), in
float32 and bf16; the `gpu` test at the end runs the compiled kernels on CUDA."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import pytest
import torch

from prelude.config import ModelConfig
from prelude.model.layers import decoder_segments as eager
from prelude.model.layers.rotary import RotaryEmbedding
from tests.model.triton_interp import Run, interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _fused() -> ModuleType:
    return interpreted("prelude.kernels.triton.fused")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: equal up to the RMSNorm sum's order; bf16: at most one rounding step apart."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if got.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _rand(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _shape(heads: int, kv_heads: int, head_dim: int) -> eager.LayerShape:
    return eager.LayerShape(heads, kv_heads, head_dim, 1e-6)


def _rope(head_dim: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=4096)
    return RotaryEmbedding(cfg, 4096, dtype, torch.device("cpu")).tables(positions)


DTYPES = ("float32", "bfloat16")


def check_norms(dtype_name: str) -> None:
    k, dtype = _fused(), getattr(torch, dtype_name)
    for t, n in ((1, 64), (7, 96), (5, 1000)):  # 96 and 1000: a tile wider than the row
        x, r = _rand(t, n, seed=1, dtype=dtype), _rand(t, n, seed=2, dtype=dtype)
        w = 1 + _rand(n, seed=3, dtype=dtype, scale=0.2)
        _close(k.rms_norm(x, w, 1e-6), eager.rms_norm(x, w, 1e-6))
        h, normed = k.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(h, x + r)  # the residual add rounds exactly like the eager one
        _close(normed, eager.rms_norm(x + r, w, 1e-6))
        # strided rows (a view into a wider tensor) read correctly
        wide = _rand(t, n + 8, seed=4, dtype=dtype)
        _close(k.rms_norm(wide[:, :n], w, 1e-6), eager.rms_norm(wide[:, :n], w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add(interp: Run, dtype: str) -> None:
    interp(check_norms, dtype)


def check_qk_norm_rope(dtype_name: str, heads: int, kv_heads: int, head_dim: int, qk_norm: bool, bias: bool) -> None:
    k, dtype = _fused(), getattr(torch, dtype_name)
    shape, t, hidden = _shape(heads, kv_heads, head_dim), 9, 48
    size = shape.q_size + 2 * shape.kv_size
    w = eager.PreAttention(
        input_norm=1 + _rand(hidden, seed=5, dtype=dtype, scale=0.2),
        qkv=_rand(size, hidden, seed=6, dtype=dtype, scale=0.2),
        qkv_bias=_rand(size, seed=7, dtype=dtype) if bias else None,
        q_norm=1 + _rand(head_dim, seed=8, dtype=dtype, scale=0.2) if qk_norm else None,
        k_norm=1 + _rand(head_dim, seed=9, dtype=dtype, scale=0.2) if qk_norm else None,
    )
    positions = torch.tensor([0, 1, 2, 700, 3, 4095, 17, 18, 5])
    cos, sin = _rope(head_dim, positions, dtype)
    h = _rand(t, hidden, seed=10, dtype=dtype)
    qkv = eager.linear(eager.rms_norm(h, w.input_norm, shape.eps), w.qkv, w.qkv_bias)
    got = k.qk_norm_rope(qkv, heads, kv_heads, head_dim, cos, sin, w.q_norm, w.k_norm, shape.eps)
    want = eager.attention_inputs(shape, h, w, cos, sin)
    for g, e in zip(got, want, strict=True):
        assert g.is_contiguous()
        _close(g, e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,qk_norm,bias",
                         [(4, 2, 16, True, False), (3, 1, 8, False, True), (2, 2, 32, True, True), (1, 1, 4, False, False)])
def test_qk_norm_rope(interp: Run, dtype: str, heads: int, kv_heads: int, head_dim: int, qk_norm: bool,
                      bias: bool) -> None:
    interp(check_qk_norm_rope, dtype, heads, kv_heads, head_dim, qk_norm, bias)


def check_silu_mul(dtype_name: str) -> None:
    k, dtype = _fused(), getattr(torch, dtype_name)
    for t, n in ((1, 40), (6, 1500)):  # 1500: two column tiles, the second partial
        gu = _rand(t, 2 * n, seed=11, dtype=dtype, scale=3.0)
        gate, up = gu.chunk(2, dim=-1)
        _close(k.silu_mul(gu), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(interp: Run, dtype: str) -> None:
    interp(check_silu_mul, dtype)


def check_segments_match_eager(dtype_name: str) -> None:
    """first -> between -> last over two layers' weights, fused vs eager."""
    fused = interpreted("prelude.model.layers.fused_segments").triton_segments()
    dtype = getattr(torch, dtype_name)
    shape, t, hidden, ff = _shape(4, 2, 16), 6, 64, 96
    size = shape.q_size + 2 * shape.kv_size
    r = lambda *s, seed: _rand(*s, seed=seed, dtype=dtype, scale=0.15)  # noqa: E731
    heads = [eager.PreAttention(1 + r(hidden, seed=20 + i), r(size, hidden, seed=30 + i), r(size, seed=40 + i),
                               1 + r(16, seed=50 + i), 1 + r(16, seed=60 + i)) for i in range(2)]
    tails = [eager.PostAttention(r(hidden, shape.q_size, seed=70 + i), 1 + r(hidden, seed=80 + i),
                               r(2 * ff, hidden, seed=90 + i), r(hidden, ff, seed=100 + i)) for i in range(2)]
    cos, sin = _rope(16, torch.arange(3, 3 + t), dtype)
    h = _rand(t, hidden, seed=12, dtype=dtype)
    attn = _rand(t, 4, 16, seed=13, dtype=dtype)
    norm = 1 + r(hidden, seed=14)
    for got, want in zip(fused.first(shape, h, heads[0], cos, sin), eager.first(shape, h, heads[0], cos, sin)):
        _close(got, want)
    got = fused.between(shape, h, attn, tails[0], heads[1], cos, sin)
    want = eager.between(shape, h, attn, tails[0], heads[1], cos, sin)
    for g, e in zip(got, want, strict=True):
        _close(g, e)
    _close(fused.last(shape, h, attn, tails[1], norm), eager.last(shape, h, attn, tails[1], norm))


@pytest.mark.parametrize("dtype", DTYPES)
def test_segments_match_eager(interp: Run, dtype: str) -> None:
    interp(check_segments_match_eager, dtype)


def check_model_forward_with_fused_segments() -> None:
    """The whole trunk of a tiny Qwen3 (torch attention backend) with fused vs eager segments."""
    from tests.model.test_triton_attention import Row, _tiny_qwen3_weights, make_batch

    fused = interpreted("prelude.model.layers.fused_segments").triton_segments()
    from prelude.model.attention import get_attention_backend
    from prelude.model.arch.qwen3 import Qwen3ForCausalLM

    cfg = ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128)
    model = Qwen3ForCausalLM(cfg, _tiny_qwen3_weights(cfg, torch.Generator().manual_seed(1)), torch.float32,
                             attention=get_attention_backend("torch"), prepack=False)
    rows = [Row(0, 6), Row(9, 1), Row(5, 7)]
    b = make_batch(rows, 4, 2, head_dim=16, block_size=4)
    ids = torch.randint(0, 97, (14,), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(r.prefix, r.prefix + r.new) for r in rows])
    outs = []
    for segments in (fused, eager.EAGER_SEGMENTS):
        caches = [(b.k_cache.clone(), b.v_cache.clone()) for _ in range(3)]
        outs.append((model.forward(ids, positions, b.meta, caches, segments=segments), caches))
    _close(outs[0][0], outs[1][0])
    for (kf, vf), (ke, ve) in zip(outs[0][1], outs[1][1]):
        _close(kf, ke)
        _close(vf, ve)


def test_model_forward_with_fused_segments(interp: Run) -> None:
    interp(check_model_forward_with_fused_segments)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_segments_on_cuda_match_eager() -> None:
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("TRITON_INTERPRET is set for this process")
    from prelude.model.layers.fused_segments import triton_segments

    dev, dtype = torch.device("cuda"), torch.bfloat16
    shape, t, hidden, ff = _shape(16, 8, 128), 37, 1024, 3072
    size = shape.q_size + 2 * shape.kv_size
    r = lambda *s, seed: _rand(*s, seed=seed, dtype=dtype, scale=s[-1] ** -0.5).to(dev)  # noqa: E731
    head = eager.PreAttention(1 + r(hidden, seed=1), r(size, hidden, seed=2), None, 1 + r(128, seed=3),
                             1 + r(128, seed=4))
    tail = eager.PostAttention(r(hidden, shape.q_size, seed=5), 1 + r(hidden, seed=6), r(2 * ff, hidden, seed=7),
                             r(hidden, ff, seed=8))
    cos, sin = (x.to(dev) for x in _rope(128, torch.arange(100, 100 + t), dtype))
    h, attn = _rand(t, hidden, seed=9, dtype=dtype).to(dev), _rand(t, 16, 128, seed=10, dtype=dtype).to(dev)
    got = triton_segments().between(shape, h, attn, tail, head, cos, sin)
    want = eager.between(shape, h, attn, tail, head, cos, sin)
    for g, e in zip(got, want, strict=True):
        _close(g.cpu(), e.cpu())
