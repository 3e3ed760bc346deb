"""The fused C kernels for float32 and bfloat16 on the CPU (model/cpu_fused.c via
cpu_fused_kernels.py) and the segments built on them, against the eager segments
(decoder_segments.py) in the same dtype."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from prelude.config import ModelConfig
from prelude.model.layers import decoder_segments as eager
from prelude.kernels.cpu import cpu_fused as cpu_fused_kernels
from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.cpu_fused import CpuFusedKernels, load_cpu_kernels
from prelude.model.layers.fused_segments import fused_segments
from prelude.model.layers.rotary import RotaryEmbedding


@pytest.fixture(scope="module", params=("native", "avx2"))
def kernels(request: pytest.FixtureRequest) -> CpuFusedKernels:
    """The library as built for this CPU (its AVX-512 / AVX512-BF16 paths where it has
    them), and built for AVX2+FMA only: the code an AVX2-only CPU runs, checked here too."""
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("no C compiler or no AVX2+FMA here")
    if request.param == "native":
        return k
    return CpuFusedKernels(ctypes.CDLL(str(cpu_fused_kernels.build(native_lib.AVX2_FLAGS))))


def test_native_build_takes_the_avx512_paths() -> None:
    """On an AVX-512 CPU the native library holds 512-bit code (and AVX512-BF16
    conversions where the CPU has them); elsewhere there is nothing to check."""
    flags = native_lib.cpu_isa_flags()
    if "avx512_f" not in flags:
        pytest.skip(f"this CPU has no AVX-512 (flags: {' '.join(sorted(f for f in flags if f.startswith('avx')))})")
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler here")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the library's instructions")
    text = subprocess.run([objdump, "-d", str(cpu_fused_kernels.build())], capture_output=True, text=True).stdout
    assert "zmm" in text
    assert ("vcvtneps2bf16" in text) == ("avx512_bf16" in flags)


DTYPES = (torch.float32, torch.bfloat16)


def _rand(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """Equal up to the order of the RMSNorm sum (and SiLU's exp): a few float32 ulps. In
    bf16 such a difference can flip a rounding, which the next rounded product can carry
    to two bf16 ulps; almost every value is bit-identical (float32 math rounded where the
    eager bf16 ops round)."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=2**-6)
    assert (got != want).sum().item() <= max(2, got.numel() // 50)


def _rope(head_dim: int, positions: torch.Tensor,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=4096)
    return RotaryEmbedding(cfg, 4096, dtype, torch.device("cpu")).tables(positions)


# (rows, width): one row; widths off the 8- and 16-lane steps; enough rows to run in parallel
SIZES = ((1, 64), (7, 100), (5, 1003), (300, 576))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", SIZES)
def test_norms_match_eager(kernels: CpuFusedKernels, rows: int, n: int, dtype: torch.dtype) -> None:
    x, r = _rand(rows, n, seed=1, dtype=dtype), _rand(rows, n, seed=2, dtype=dtype)
    w = 1 + _rand(n, seed=3, scale=0.2, dtype=dtype)
    _close(kernels.rms_norm(x, w, 1e-6), eager.rms_norm(x, w, 1e-6), dtype)
    h, normed = kernels.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r)  # the residual add rounds exactly like the eager one
    _close(normed, eager.rms_norm(x + r, w, 1e-6), dtype)
    wide = _rand(rows, n + 24, seed=4, dtype=dtype)  # strided rows: a view into a wider tensor
    h, normed = kernels.add_rms_norm(wide[:, 8 : 8 + n], r, w, 1e-6)
    assert torch.equal(h, wide[:, 8 : 8 + n] + r)
    _close(normed, eager.rms_norm(wide[:, 8 : 8 + n] + r, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
# n = 59 reaches each of the C loop's steps: two 16-lane vectors, one, 8 lanes, single values
@pytest.mark.parametrize("rows,n", ((1, 40), (3, 13), (2, 59), (64, 1536)))
def test_silu_mul_matches_eager(kernels: CpuFusedKernels, rows: int, n: int, dtype: torch.dtype) -> None:
    gu = _rand(rows, 2 * n, seed=11, scale=4.0)
    gu[0, :4] = torch.tensor([-120.0, -87.5, 60.0, 0.0])  # exp's clamps and zero
    gu = gu.to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    _close(kernels.silu_mul(gu), F.silu(gate) * up, dtype)
    strided = torch.cat([gu, _rand(rows, 5, seed=12, dtype=dtype)], dim=1)[:, : 2 * n]
    _close(kernels.silu_mul(strided), F.silu(gate) * up, dtype)


def _eager_qkv(shape: eager.LayerShape, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None) -> eager.QKV:
    q, k, v = qkv.split([shape.q_size, shape.kv_size, shape.kv_size], dim=-1)
    q = q.reshape(-1, shape.num_heads, shape.head_dim)
    k = k.reshape(-1, shape.num_kv_heads, shape.head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = eager.rms_norm(q, q_norm, shape.eps), eager.rms_norm(k, k_norm, shape.eps)
    return eager.rotate(q, cos, sin), eager.rotate(k, cos, sin), v.reshape(-1, shape.num_kv_heads, shape.head_dim)


@pytest.mark.parametrize("heads,kv_heads,head_dim,rows", ((9, 3, 64, 5), (4, 4, 16, 1), (5, 1, 20, 3),
                                                           (2, 1, 6, 2), (16, 8, 128, 40)))
@pytest.mark.parametrize("qk_norm", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_matches_eager(kernels: CpuFusedKernels, heads: int, kv_heads: int, head_dim: int, rows: int,
                                    qk_norm: bool, dtype: torch.dtype) -> None:
    shape = eager.LayerShape(heads, kv_heads, head_dim, 1e-6)
    qkv = _rand(rows, shape.q_size + 2 * shape.kv_size, seed=21, dtype=dtype)
    cos, sin = _rope(head_dim, torch.arange(7, 7 + rows), dtype)
    norms = ((1 + _rand(head_dim, seed=22, scale=0.2, dtype=dtype), 1 + _rand(head_dim, seed=23, scale=0.2, dtype=dtype))
             if qk_norm else (None, None))
    got = kernels.qk_norm_rope(qkv, heads, kv_heads, head_dim, cos, sin, *norms, 1e-6)
    want = _eager_qkv(shape, qkv, cos, sin, *norms)
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous()
        if qk_norm:
            _close(g, w, dtype)
        else:
            assert torch.equal(g, w)  # split, rotary and copy round exactly like the eager ops


def test_refusals(kernels: CpuFusedKernels) -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="one dtype"):  # a float32 weight beside bf16 rows
        kernels.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    cos, sin = _rope(8, torch.arange(2))
    with pytest.raises(ValueError, match="head_dim"):
        kernels.qk_norm_rope(torch.zeros(2, 21), 1, 1, 7, cos, sin, None, None, 1e-6)
    with pytest.raises(ValueError, match="width"):
        kernels.qk_norm_rope(torch.zeros(2, 20), 1, 1, 8, cos, sin, None, None, 1e-6)
    with pytest.raises(ValueError, match="cos/sin"):
        kernels.qk_norm_rope(torch.zeros(2, 24), 1, 1, 8, cos[:1], sin[:1], None, None, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_segments_match_eager(kernels: CpuFusedKernels, dtype: torch.dtype) -> None:
    """first -> between -> last over two layers' weights (with qkv bias and q/k norms)."""
    fused = fused_segments(kernels, "cpu")
    shape, t, hidden, ff = eager.LayerShape(4, 2, 16, 1e-6), 6, 64, 96
    size = shape.q_size + 2 * shape.kv_size
    r = lambda *s, seed: _rand(*s, seed=seed, scale=0.15, dtype=dtype)  # noqa: E731
    heads = [eager.PreAttention(1 + r(hidden, seed=20 + i), r(size, hidden, seed=30 + i), r(size, seed=40 + i),
                               1 + r(16, seed=50 + i), 1 + r(16, seed=60 + i)) for i in range(2)]
    tails = [eager.PostAttention(r(hidden, shape.q_size, seed=70 + i), 1 + r(hidden, seed=80 + i),
                               r(2 * ff, hidden, seed=90 + i), r(hidden, ff, seed=100 + i)) for i in range(2)]
    cos, sin = _rope(16, torch.arange(3, 3 + t), dtype)
    h, attn = _rand(t, hidden, seed=12, dtype=dtype), _rand(t, 4, 16, seed=13, dtype=dtype)
    norm = 1 + r(hidden, seed=14)
    for got, want in zip(fused.first(shape, h, heads[0], cos, sin), eager.first(shape, h, heads[0], cos, sin),
                         strict=True):
        _close(got, want, dtype)
    got = fused.between(shape, h, attn, tails[0], heads[1], cos, sin)
    for g, e in zip(got, eager.between(shape, h, attn, tails[0], heads[1], cos, sin), strict=True):
        _close(g, e, dtype)
    _close(fused.last(shape, h, attn, tails[1], norm), eager.last(shape, h, attn, tails[1], norm), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_forward_and_greedy_tokens_match_eager(kernels: CpuFusedKernels, dtype: torch.dtype) -> None:
    """A random-weight Llama through LlamaForCausalLM: prefill then decode rows, fused vs
    eager segments: hidden states close, written K/V close, the same greedy tokens (in
    bf16: hidden states and K/V within a few bf16 ulps, the three layers' roundings)."""
    from tests.model.test_triton_attention import Row, make_batch

    from prelude.model.attention import get_attention_backend
    from prelude.model.arch.llama import LlamaForCausalLM

    cfg = ModelConfig(model_type="llama", vocab_size=101, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128)
    g = torch.Generator().manual_seed(5)
    weights = {"model.embed_tokens.weight": torch.randn(101, 64, generator=g) * 0.5,
               "model.norm.weight": 1 + torch.randn(64, generator=g) * 0.1}
    for i in range(3):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)),
                            ("self_attn.v_proj", (32, 64)), ("self_attn.o_proj", (64, 64)),
                            ("mlp.gate_proj", (160, 64)), ("mlp.up_proj", (160, 64)), ("mlp.down_proj", (64, 160))):
            weights[f"{p}{name}.weight"] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{p}{norm}.weight"] = 1 + torch.randn(64, generator=g) * 0.1
    model = LlamaForCausalLM(cfg, weights, dtype, attention=get_attention_backend("torch"), prepack=False)
    rows = [Row(0, 9), Row(11, 1), Row(4, 6), Row(20, 1)]
    b = make_batch(rows, 4, 2, head_dim=16, block_size=4, dtype=dtype)
    ids = torch.randint(0, 101, (17,), generator=torch.Generator().manual_seed(6))
    positions = torch.cat([torch.arange(r.prefix, r.prefix + r.new) for r in rows])
    outs = []
    for segments in (fused_segments(kernels, "cpu"), eager.EAGER_SEGMENTS):
        caches = [(b.k_cache.clone(), b.v_cache.clone()) for _ in range(3)]
        hidden = model.forward(ids, positions, b.meta, caches, segments=segments)
        outs.append((hidden, caches, model.compute_logits(hidden).argmax(-1)))
    if dtype == torch.float32:
        close = _close
    else:
        def close(got: torch.Tensor, want: torch.Tensor) -> None:
            assert got.dtype == want.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.05)
    close(outs[0][0], outs[1][0])
    for (kf, vf), (ke, ve) in zip(outs[0][1], outs[1][1], strict=True):
        close(kf, ke)
        close(vf, ve)
    assert torch.equal(outs[0][2], outs[1][2])
