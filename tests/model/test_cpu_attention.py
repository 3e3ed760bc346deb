"""The C paged-attention backend (cpu_attention.c) against the eager torch backend.

Every batch reads K/V through shuffled block tables over a pool whose other slots (block 0,
which pads the tables, included) hold 1e4: a read outside a row's keys would swamp its output
(not NaN: the eager reference multiplies masked values by 0). bf16 runs are compared with the torch backend in float32 on
the same rounded inputs."""

from __future__ import annotations

from dataclasses import dataclass, replace

import ctypes
import shutil
import subprocess

import pytest
import torch

from prelude.kernels.cpu import cpu_attention, native_lib
from prelude.model.attention import cpu_backend, get_attention_backend
from prelude.model.attention.cpu_backend import CpuAttention, load_cpu_attention
from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillSlice
from prelude.model.attention.torch_backend import TorchAttention

_BACKEND = load_cpu_attention()
_BACKEND_LIB = None if _BACKEND is None else cpu_attention.declare(ctypes.CDLL(str(cpu_attention.build())))
pytestmark = pytest.mark.skipif(_BACKEND is None, reason="the C attention kernel does not build here "
                                "(no C compiler, no AVX2+FMA, or PRELUDE_CPU_ATTENTION=0)")


@pytest.fixture(scope="module", params=("native", "amx", "avx2"))
def backend(request: pytest.FixtureRequest) -> CpuAttention:
    """The kernel as built for this CPU: its AVX512-BF16 forms where it has them ("native",
    the AMX form off), and its bf16 prefill items on AMX tiles ("amx", where the CPU has
    AMX-BF16); and built for AVX2+FMA only: the float32 code an AVX2-only CPU runs for either
    dtype."""
    assert _BACKEND is not None
    if request.param == "native":
        return CpuAttention(_BACKEND_LIB, amx=False)
    if request.param == "amx":
        amx = CpuAttention(_BACKEND_LIB, amx=True)
        if not amx.amx:
            flags = native_lib.cpu_isa_flags()
            pytest.skip("no AMX form here: " + ("the OS refused the tile registers" if "amx_bf16" in flags else
                        f"this CPU has no AMX-BF16 (flags: {' '.join(sorted(f for f in flags if f.startswith(('avx', 'amx'))))})"))
        return amx
    flags = tuple(f for f in native_lib.AVX2_FLAGS if f != "-ffp-contract=off")
    return CpuAttention(cpu_attention.declare(ctypes.CDLL(str(native_lib.build(cpu_attention._SOURCE, flags)))))


def _native_instructions(flag: str, what: str) -> str:
    """The native library's disassembly; skips where the CPU lacks `flag` or no objdump."""
    flags = native_lib.cpu_isa_flags()
    if flag not in flags:
        pytest.skip(f"this CPU has no {what} (flags: {' '.join(sorted(f for f in flags if f.startswith(('avx', 'amx'))))})")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the library's instructions")
    return subprocess.run([objdump, "-d", str(cpu_attention.build())], capture_output=True, text=True).stdout


def test_native_build_takes_the_bf16_dot_product_where_the_cpu_has_it() -> None:
    assert "vdpbf16ps" in _native_instructions("avx512_bf16", "AVX512-BF16")


def test_native_build_takes_amx_tiles_where_the_cpu_has_them() -> None:
    text = _native_instructions("amx_bf16", "AMX-BF16")
    assert "tdpbf16ps" in text and "ldtilecfg" in text


def test_the_backend_says_which_bf16_math_its_build_has(backend: CpuAttention, request: pytest.FixtureRequest) -> None:
    native = request.node.callspec.params["backend"] != "avx2"
    assert backend.bf16_dot_product == (native and "avx512_bf16" in native_lib.cpu_isa_flags())
    assert ("dot product" in backend.describe(torch.bfloat16)) == backend.bf16_dot_product
    assert ("AMX" in backend.describe(torch.bfloat16)) == backend.amx


def test_amx_follows_its_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _BACKEND_LIB is not None
    assert CpuAttention(_BACKEND_LIB, amx=False).amx is False
    monkeypatch.setenv(cpu_backend.AMX_SWITCH, "0")
    assert CpuAttention(_BACKEND_LIB).amx is False
    monkeypatch.setenv(cpu_backend.AMX_SWITCH, "1")
    ready = _BACKEND_LIB.amx_ready
    assert CpuAttention(_BACKEND_LIB).amx == ready == CpuAttention(_BACKEND_LIB, amx=True).amx
    if "amx_bf16" not in native_lib.cpu_isa_flags():  # with it, the OS may still refuse the tiles
        assert not ready


@dataclass(frozen=True)
class Row:
    """`prefix` cached tokens, then `new` tokens in this forward. own_in_cache: the new
    tokens' K/V are written to the pool before attention (chunked prefill, decode); False: a
    OneShot row (its own K/V are the forward's). segments: ids of the new tokens."""

    prefix: int
    new: int
    own_in_cache: bool = True
    segments: tuple[int, ...] | None = None


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(rows: list[Row], heads: int, kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    per_row = [(r.prefix + r.new + block_size - 1) // block_size for r in rows]
    num_blocks = sum(per_row) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: never a row's
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, 1e4, dtype=dtype)
    v_cache = torch.full(shape, 1e4, dtype=dtype)
    total = sum(r.new for r in rows)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    # k and v as strided views of one qkv-like row, as the model makes them
    kv = torch.randn(total, 2 * kv_heads * head_dim + 8, generator=gen).to(dtype)
    k = kv[:, : kv_heads * head_dim].view(total, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(total, kv_heads, head_dim)
    slots: list[int] = []
    segments: list[int] = []
    prefills: list[PrefillSlice] = []
    dec_index, dec_tables, dec_lens = [], [], []
    start, used = 0, 0
    for r, nb in zip(rows, per_row):
        table = torch.tensor(order[used : used + nb], dtype=torch.int64)
        used += nb
        for p in range(r.prefix):  # the cached prefix
            b, o = int(table[p // block_size]), p % block_size
            k_cache[b, o] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[b, o] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
        ctx = r.prefix + r.new
        for p in range(r.prefix, ctx):
            slots.append(int(table[p // block_size]) * block_size + p % block_size if r.own_in_cache else -1)
        segments.extend(r.segments if r.segments is not None else [0] * r.new)
        if r.new == 1 and r.own_in_cache and r.segments is None:
            dec_index.append(start)
            dec_tables.append(table)
            dec_lens.append(ctx)
        else:
            prefills.append(PrefillSlice(start, r.new, ctx, table, own_kv_in_cache=r.own_in_cache,
                                         segmented=r.segments is not None))
        start += r.new
    decodes = None
    if dec_index:
        width = max(t.numel() for t in dec_tables)
        padded = torch.zeros(len(dec_tables), width, dtype=torch.int64)
        for i, t in enumerate(dec_tables):
            padded[i, : t.numel()] = t
        decodes = DecodeRows(torch.tensor(dec_index), padded, torch.tensor(dec_lens), max(dec_lens))
    kept = [i for i, s in enumerate(slots) if s >= 0]
    slot_mapping = torch.tensor(slots, dtype=torch.int64) if kept else None
    kept_tokens = torch.tensor(kept) if kept and len(kept) < len(slots) else None
    seg = torch.tensor(segments, dtype=torch.int64) if any(r.segments is not None for r in rows) else None
    meta = AttentionMetadata(slot_mapping, tuple(prefills), decodes, block_size, kept_tokens=kept_tokens,
                             segment_ids=seg)
    return Batch(q, k, v, k_cache, v_cache, meta)


def check(backend: CpuAttention, b: Batch, scale: float = 0.3, ref_dtype: torch.dtype = torch.float32,
          fp32_tol: float = 1e-5) -> None:
    """ref_dtype: the eager reference's precision; fp32_tol: float32's tolerance (scores of
    tens of units carry rounding errors that large times their size)."""
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, scale)
    f = lambda x: x.to(ref_dtype, copy=True)  # noqa: E731
    rkc, rvc = f(b.k_cache), f(b.v_cache)
    ref = TorchAttention().forward(f(b.q), f(b.k), f(b.v), rkc, rvc, b.meta, scale).float()
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    assert torch.isfinite(out).all()
    tol = fp32_tol if b.q.dtype == torch.float32 else 1.6e-2  # bf16: its rounding of the output
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # the KV write put exactly the new K/V where the eager index_copy_ does
    assert torch.equal(kc.float(), rkc.to(b.q.dtype).float()) and torch.equal(vc.float(), rvc.to(b.q.dtype).float())


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 44, 37])  # 44: a 4-wide tail past the 8-wide blocks
def test_mixed_prefill_and_decode_rows(backend: CpuAttention, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    # fresh prompt, chunk over a cached prefix, OneShot with and without prefix, decodes between
    rows = [Row(0, 7), Row(1, 1), Row(20, 6), Row(9, 1), Row(13, 3, own_in_cache=False),
            Row(0, 5, own_in_cache=False), Row(3, 1), Row(31, 2)]
    check(backend, make_batch(rows, heads, kv_heads, head_dim, block_size=8, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_block_boundaries(backend: CpuAttention, dtype: torch.dtype, block_size: int) -> None:
    # contexts before, at and after block and key-tile (16) edges; decodes and chunks
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 1, 15, 16, 17, 33]
    rows = [Row(n - 1, 1) for n in lens if n > 0] + [Row(n, 4) for n in lens]
    check(backend, make_batch(rows, 6, 2, 24, block_size=block_size, dtype=dtype, seed=block_size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("own_in_cache", [True, False])
def test_long_suffixes_over_prefixes(backend: CpuAttention, dtype: torch.dtype, own_in_cache: bool) -> None:
    # the judge's shape in small (prefix + 64 new), a suffix spanning several query tiles, no prefix
    rows = [Row(100, 64, own_in_cache), Row(0, 150, own_in_cache), Row(37, 90, own_in_cache), Row(16, 2)]
    check(backend, make_batch(rows, 9, 3, 64, block_size=16, dtype=dtype, seed=3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_causal_rows_whose_query_tiles_end_before_later_key_tiles(backend: CpuAttention, dtype: torch.dtype,
                                                                   heads: int, kv_heads: int) -> None:
    # Long causal rows, fresh and over a prefix: a query tile's first query vectors see none of
    # its later key tiles, which the kernel skips for them. Over 49 cached tokens a vector's
    # last query sits exactly on a key tile's first key (it must still see that key).
    rows = [Row(0, 150, own_in_cache=False), Row(0, 200), Row(49, 100, own_in_cache=False), Row(49, 100),
            Row(3, 1)]
    check(backend, make_batch(rows, heads, kv_heads, 64, block_size=16, dtype=dtype, seed=7))


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_item_segments(backend: CpuAttention, dtype: torch.dtype) -> None:
    # a query (segment 0) then items 1..3, over a cached prefix; a plain row and a decode beside it
    seg = (0, 0, 0, 1, 1, 2, 2, 2, 3)
    rows = [Row(10, len(seg), own_in_cache=False, segments=seg), Row(5, 6), Row(7, len(seg), segments=seg),
            Row(4, 1), Row(6, 3, segments=(0, 1, 2))]  # the last: 9 query vectors, the narrow form
    check(backend, make_batch(rows, 9, 3, 32, block_size=4, dtype=dtype, seed=5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_peaked_scores_move_the_softmax_reference_max(backend: CpuAttention, dtype: torch.dtype) -> None:
    # A large scale spreads the scores over tens of log2 units: tile maxima pass the running
    # reference max by more than the kernel's lazy-rescale margin (the accumulator is
    # rescaled) and by less (it is not, and probabilities above 1 accumulate): both must
    # give the exact softmax. Long contexts (many key tiles), a chunk, OneShot rows, decodes.
    rows = [Row(300, 40, own_in_cache=False), Row(0, 120), Row(200, 1), Row(77, 33), Row(500, 1)]
    check(backend, make_batch(rows, 9, 3, 64, block_size=16, dtype=dtype, seed=11), scale=1.0,
          ref_dtype=torch.float64, fp32_tol=5e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tail_queries_attend_only_each_rows_last_queries(backend: CpuAttention, dtype: torch.dtype) -> None:
    # The last layer of a forward whose heads read only some positions: per prefill row, the
    # last `tail` queries (all, some, one, none); decode rows always; every K/V still written.
    seg = (0, 0, 0, 1, 1, 2, 2, 2, 3)
    rows = [Row(0, 40), Row(1, 1), Row(20, 37), Row(13, 3, own_in_cache=False), Row(0, 5, own_in_cache=False),
            Row(3, 1), Row(31, 50), Row(10, len(seg), own_in_cache=False, segments=seg), Row(9, 6)]
    tails = [40, 1, 3, 0, 37, 5, 1]  # the prefill rows' (the decode rows are apart)
    b = make_batch(rows, 9, 3, 64, block_size=8, dtype=dtype, seed=7)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, 0.3, tail_queries=torch.tensor(tails))
    f = (lambda x: x.float()) if dtype != torch.float32 else (lambda x: x.clone())  # noqa: E731
    rkc, rvc = f(b.k_cache), f(b.v_cache)
    ref = TorchAttention().forward(f(b.q), f(b.k), f(b.v), rkc, rvc, b.meta, 0.3)
    read = [s.query_start + s.query_len - n + j for s, n in zip(b.meta.prefills, tails, strict=True) for j in range(n)]
    assert b.meta.decodes is not None
    read = torch.tensor(sorted(read + b.meta.decodes.query_index.tolist()))
    assert 0 < read.numel() < b.q.shape[0]
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.index_select(0, read).float(), ref.index_select(0, read), atol=tol, rtol=tol)
    assert torch.equal(kc.float(), rkc.to(dtype).float()) and torch.equal(vc.float(), rvc.to(dtype).float())
    with pytest.raises(ValueError, match="one count per prefill row"):
        backend.forward(b.q, b.k, b.v, kc, vc, b.meta, 0.3, tail_queries=torch.tensor(tails[:-1]))
    with pytest.raises(RuntimeError, match="refused"):  # a tail longer than its row
        backend.forward(b.q, b.k, b.v, kc, vc, b.meta, 0.3, tail_queries=torch.tensor([41, *tails[1:]]))


def test_write_kv_skips_unkept_tokens() -> None:
    assert _BACKEND is not None
    cache = torch.zeros(3, 4, 2, 5)
    k, v = torch.randn(4, 2, 5), torch.randn(4, 2, 5)
    kc, vc = cache.clone(), cache.clone()
    _BACKEND.write_kv(kc, vc, k, v, torch.tensor([9, -1, 0, 4]))
    assert torch.equal(kc[2, 1], k[0]) and torch.equal(kc[0, 0], k[2]) and torch.equal(vc[1, 0], v[3])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3  # nothing written for the -1 slot


def test_registry_picks_the_kernel_on_cpu_and_sdpa_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(get_attention_backend("cpu", torch.device("cpu")), CpuAttention)
    monkeypatch.setenv("PRELUDE_CPU_ATTENTION", "0")
    assert isinstance(get_attention_backend("cpu", torch.device("cpu")), TorchAttention)


def _released(meta: AttentionMetadata, window: int, marker: int) -> AttentionMetadata:
    """`meta` with each row's table entries for blocks wholly before its first query's
    window set to `marker`, as a sliding layer's table holds them once released."""
    bs = meta.block_size

    def cut(table: torch.Tensor, first_query: int) -> torch.Tensor:
        out = table.clone()
        out[: max(0, first_query - window + 1) // bs] = marker
        return out

    prefills = tuple(replace(s, block_table=cut(s.block_table, s.context_len - s.query_len)) for s in meta.prefills)
    decodes = meta.decodes
    if decodes is not None:
        tables = torch.stack([cut(t, int(n) - 1) for t, n in zip(decodes.block_tables, decodes.context_lens)])
        decodes = replace(decodes, block_tables=tables)
    return replace(meta, prefills=prefills, decodes=decodes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("released", ["poisoned", "negative"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (37, 5)])  # 37: an odd head_dim, pairs padded
def test_window_sees_only_each_querys_last_positions(backend: CpuAttention, dtype: torch.dtype, window: int,
                                                     released: str, head_dim: int, block_size: int) -> None:
    # A sliding-window layer: fresh prompts longer than the window, chunks over long prefixes
    # (own K/V in the pool or the forward's), decodes, segments, against the torch backend's
    # masked reference. The blocks wholly before each row's first window are "released": their
    # entries point at a NaN block, or are -1 (never read: a read would put NaN in the output
    # or fault).
    seg = (0, 0, 0, 1, 1, 2, 2, 2, 3)
    rows = [Row(0, 150), Row(0, 90, own_in_cache=False), Row(100, 64), Row(77, 33, own_in_cache=False),
            Row(200, 1), Row(39, 1), Row(5, 1), Row(60, 3), Row(30, len(seg), own_in_cache=False, segments=seg)]
    b = make_batch(rows, 9, 3, head_dim, block_size=block_size, dtype=dtype, seed=window)
    held = {int(x) for s in b.meta.prefills for x in s.block_table}
    assert b.meta.decodes is not None
    held |= {int(x) for x in b.meta.decodes.block_tables.flatten()}
    marker = max(set(range(b.k_cache.shape[0])) - held)  # a spare block, no row's
    if released == "negative":
        marker = -1
    else:
        b.k_cache[marker] = float("nan")
        b.v_cache[marker] = float("nan")
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, kc, vc, _released(b.meta, window, marker), 0.3, window=window)
    f = (lambda x: x.float()) if dtype != torch.float32 else (lambda x: x.clone())  # noqa: E731
    ref = TorchAttention().forward(f(b.q), f(b.k), f(b.v), f(b.k_cache), f(b.v_cache), b.meta, 0.3, window=window)
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # and the window changes the answer: without it the rows see their whole prefix
    full = TorchAttention().forward(f(b.q), f(b.k), f(b.v), f(b.k_cache), f(b.v_cache), b.meta, 0.3)
    assert not torch.allclose(full.float(), ref.float(), atol=0.1)
