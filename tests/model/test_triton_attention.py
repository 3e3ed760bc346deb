"""Triton attention kernels vs the torch backend, on the CPU under TRITON_INTERPRET=1
(tests/model/triton_interp.py: each test is a thin wrapper that runs its `check_*` function
in the interpreter worker); the `gpu` tests at the end import the real, compiled kernels."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch

from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillSlice
from prelude.model.attention.torch_backend import TorchAttention
from tests.model.triton_interp import Run, interpreted

# find_spec, not importorskip: importing triton here would fix it in compiled mode
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_KERNELS = "prelude.kernels.triton.attention"
_BACKEND = "prelude.model.attention.triton_backend"


def _kernels() -> ModuleType:
    return interpreted(_KERNELS)


def _backend() -> ModuleType:
    _kernels()
    return interpreted(_BACKEND)


# --- building a batch --------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One row of a test batch: `prefix` cached tokens, then `new` tokens in this forward.

    own_in_cache: the new tokens' K/V are written to the cache this step (chunked prefill,
    decode); False: a OneShot row, whose K/V are temporaries (publish: written anyway)."""

    prefix: int
    new: int
    own_in_cache: bool = True
    publish: bool = False


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(
    rows: list[Row], num_heads: int, num_kv_heads: int, head_dim: int = 16, block_size: int = 4,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = [(r.prefix + r.new + block_size - 1) // block_size for r in rows]
    num_blocks = sum(blocks_per_row) + 3
    # Non-contiguous, shuffled block tables; unused blocks hold noise that must not be read.
    order = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    total = sum(r.new for r in rows)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    # k and v as strided views of one qkv-like tensor, as the model produces them
    kv = torch.randn(total, 2 * num_kv_heads * head_dim + 8, generator=gen).to(dtype)
    k = kv[:, : num_kv_heads * head_dim].view(total, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(total, num_kv_heads, head_dim)

    slots: list[int] = []
    prefills: list[PrefillSlice] = []
    dec_index: list[int] = []
    dec_tables: list[torch.Tensor] = []
    dec_lens: list[int] = []
    start, used = 0, 0
    for r, nb in zip(rows, blocks_per_row):
        table = order[used : used + nb].clone()
        used += nb
        ctx = r.prefix + r.new
        for p in range(r.prefix, ctx):
            written = r.own_in_cache or r.publish
            slots.append(int(table[p // block_size]) * block_size + p % block_size if written else -1)
        if r.new == 1 and r.own_in_cache:
            dec_index.append(start)
            dec_tables.append(table)
            dec_lens.append(ctx)
        else:
            prefills.append(PrefillSlice(start, r.new, ctx, table, own_kv_in_cache=r.own_in_cache))
        start += r.new
    decodes = None
    if dec_index:
        width = max(t.numel() for t in dec_tables)
        padded = torch.zeros(len(dec_tables), width, dtype=torch.long)
        for i, t in enumerate(dec_tables):
            padded[i, : t.numel()] = t
        decodes = DecodeRows(torch.tensor(dec_index), padded, torch.tensor(dec_lens), max(dec_lens))
    slot_mapping = torch.tensor(slots, dtype=torch.long) if any(s >= 0 for s in slots) else None
    kept = [i for i, s in enumerate(slots) if s >= 0]
    kept_tokens = torch.tensor(kept, dtype=torch.long) if slot_mapping is not None and len(kept) < len(slots) else None
    meta = AttentionMetadata(slot_mapping, tuple(prefills), decodes, block_size, kept_tokens=kept_tokens)
    return Batch(q, k, v, k_cache, v_cache, meta)


def run_both(b: Batch, scale: float = 0.25) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """(triton out, torch out, triton caches, torch caches), each backend on its own caches."""
    caches_t = (b.k_cache.clone(), b.v_cache.clone())
    caches_r = (b.k_cache.clone(), b.v_cache.clone())
    out_t = _backend().TritonAttention().forward(b.q, b.k, b.v, *caches_t, b.meta, scale)
    if b.q.dtype == torch.float32:
        out_r = TorchAttention().forward(b.q, b.k, b.v, *caches_r, b.meta, scale)
    else:  # the reference in float32 on the same (rounded) inputs
        f = lambda x: x.float()  # noqa: E731
        caches_r = (f(caches_r[0]), f(caches_r[1]))
        out_r = TorchAttention().forward(f(b.q), f(b.k), f(b.v), *caches_r, b.meta, scale)
    return out_t, out_r, caches_t, caches_r


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4) -> None:
    assert a.shape == b.shape
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=atol)


# --- the backend against the torch backend --------------------------------------------------


def check_mixed_batch_gqa(num_heads: int, num_kv_heads: int) -> None:
    # fresh prompt, chunk over a cached prefix, OneShot with and without prefix, decodes between
    rows = [
        Row(0, 7), Row(1, 1), Row(5, 6), Row(9, 1), Row(4, 3, own_in_cache=False),
        Row(0, 5, own_in_cache=False), Row(3, 1),
    ]
    b = make_batch(rows, num_heads, num_kv_heads)
    out_t, out_r, caches_t, caches_r = run_both(b)
    assert_close(out_t, out_r)
    assert torch.equal(caches_t[0], caches_r[0]) and torch.equal(caches_t[1], caches_r[1])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (6, 1)])
def test_mixed_batch_gqa(interp: Run, num_heads: int, num_kv_heads: int) -> None:
    interp(check_mixed_batch_gqa, num_heads, num_kv_heads)


def check_decode_block_boundaries(block_size: int) -> None:
    # contexts just before, at and after multiples of the block size (and of the key tile)
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 2 * block_size + 1, 33]
    b = make_batch([Row(n - 1, 1) for n in lens if n > 0], 4, 2, block_size=block_size)
    out_t, out_r, caches_t, caches_r = run_both(b)
    assert_close(out_t, out_r)
    assert torch.equal(caches_t[0], caches_r[0])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_block_boundaries(interp: Run, block_size: int) -> None:
    interp(check_decode_block_boundaries, block_size)


def check_prefill_block_boundaries_and_prefixes() -> None:
    # prefixes empty / mid-block / block-aligned, suffixes crossing block and query-tile edges
    rows = [Row(p, n) for p, n in [(0, 4), (0, 17), (3, 2), (4, 4), (5, 12), (8, 17), (12, 3)]]
    b = make_batch(rows, 4, 2, block_size=4)
    out_t, out_r, *_ = run_both(b)
    assert_close(out_t, out_r)


def test_prefill_block_boundaries_and_prefixes(interp: Run) -> None:
    interp(check_prefill_block_boundaries_and_prefixes)


def check_prefill_padding_rows_and_tiles() -> None:
    # What a captured graph would launch: extra rows with query_len 0, a larger
    # max_query_len, other tile sizes; the real rows' answers do not change.
    tri, backend = _kernels(), _backend()
    b = make_batch([Row(0, 5), Row(6, 20), Row(3, 2, own_in_cache=False)], 4, 2)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    tri.write_kv(kc, vc, b.k, b.v, b.meta.slot_mapping)
    rows = backend.prefill_rows(b.meta.prefills, b.q.device)
    exact = torch.zeros_like(b.q)
    tri.prefill_attention(b.q, b.k, b.v, kc, vc, exact, rows, 0.25)
    pad = lambda t: torch.cat([t, torch.zeros(2, *t.shape[1:], dtype=t.dtype)])  # noqa: E731
    padded = tri.PrefillRows(pad(rows.query_start), pad(rows.query_lens), pad(rows.context_lens),
                             pad(rows.own_kv_in_cache), pad(rows.block_tables), max_query_len=64)
    for block_m, block_n in [(None, 32), (16, 16), (32, 64)]:
        out = torch.zeros_like(b.q)
        tri.prefill_attention(b.q, b.k, b.v, kc, vc, out, padded, 0.25, block_m=block_m, block_n=block_n)
        assert_close(out, exact, atol=1e-5)


def test_prefill_padding_rows_and_tiles(interp: Run) -> None:
    interp(check_prefill_padding_rows_and_tiles)


def check_oneshot_rows(publish: bool) -> None:
    rows = [Row(p, n, own_in_cache=False, publish=publish) for p, n in [(0, 9), (4, 5), (7, 18), (8, 2)]]
    b = make_batch(rows, 4, 2)
    out_t, out_r, caches_t, caches_r = run_both(b)
    assert_close(out_t, out_r)
    assert torch.equal(caches_t[0], caches_r[0]) and torch.equal(caches_t[1], caches_r[1])
    if not publish:  # nothing written: the caches are untouched
        assert b.meta.slot_mapping is None and torch.equal(caches_t[0], b.k_cache)


@pytest.mark.parametrize("publish", [False, True])
def test_oneshot_rows_read_own_kv_from_the_forward(interp: Run, publish: bool) -> None:
    interp(check_oneshot_rows, publish)


def check_oneshot_ignores_own_slots_in_cache() -> None:
    # The row's own slots hold garbage: a OneShot row must take its own K/V from k/v only,
    # and the prefix from the cache (garbage there must change the answer).
    b = make_batch([Row(4, 6, own_in_cache=False)], 4, 2)
    attend = lambda kc, vc: _backend().TritonAttention().forward(b.q, b.k, b.v, kc, vc, b.meta, 0.25)  # noqa: E731
    table = b.meta.prefills[0].block_table
    own_garbage_k, own_garbage_v = b.k_cache.clone(), b.v_cache.clone()
    for p in range(4, 10):
        own_garbage_k[table[p // 4], p % 4] = 1e3
        own_garbage_v[table[p // 4], p % 4] = 1e3
    prefix_garbage_k = b.k_cache.clone()
    prefix_garbage_k[table[0], 1] = 1e3
    clean = attend(b.k_cache, b.v_cache)
    assert torch.equal(clean, attend(own_garbage_k, own_garbage_v))
    assert not torch.allclose(clean, attend(prefix_garbage_k, b.v_cache))


def test_oneshot_ignores_own_slots_in_cache(interp: Run) -> None:
    interp(check_oneshot_ignores_own_slots_in_cache)


def check_bf16_inputs() -> None:
    rows = [Row(0, 6), Row(5, 1), Row(3, 9), Row(6, 4, own_in_cache=False)]
    b = make_batch(rows, 4, 2, dtype=torch.bfloat16)
    out_t, out_r, *_ = run_both(b)
    assert out_t.dtype == torch.bfloat16
    assert_close(out_t, out_r, atol=2e-2)


def test_bf16_inputs(interp: Run) -> None:
    interp(check_bf16_inputs)


def check_backend_reuses_converted_metadata() -> None:
    b = make_batch([Row(2, 5), Row(3, 1)], 4, 2)
    attn = _backend().TritonAttention()
    first = attn._inputs(b.meta, 2, b.q.device)
    assert attn._inputs(b.meta, 2, b.q.device) is first
    other = make_batch([Row(2, 5)], 4, 2).meta
    assert attn._inputs(other, 2, b.q.device) is not first


def test_backend_reuses_converted_metadata_across_layers(interp: Run) -> None:
    interp(check_backend_reuses_converted_metadata)


def check_registry_builds_triton_backend() -> None:
    from prelude.model.attention import get_attention_backend

    _kernels()
    assert get_attention_backend("triton").name == "triton"


def test_registry_builds_triton_backend(interp: Run) -> None:
    interp(check_registry_builds_triton_backend)


def _tiny_qwen3_weights(cfg: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, ff, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    r = lambda *shape: torch.randn(*shape, generator=gen) * 0.2  # noqa: E731
    w = {
        "model.embed_tokens.weight": r(cfg.vocab_size, h),
        "model.norm.weight": 1 + r(h),
        "lm_head.weight": r(cfg.vocab_size, h),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
            p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
            p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
            p + "self_attn.q_norm.weight": 1 + r(d), p + "self_attn.k_norm.weight": 1 + r(d),
            p + "mlp.gate_proj.weight": r(ff, h), p + "mlp.up_proj.weight": r(ff, h),
            p + "mlp.down_proj.weight": r(h, ff),
        }
    return w


def check_model_forward_matches_torch_backend() -> None:
    # The whole trunk (RoPE'd, q/k-normed, strided k/v views) on one mixed batch over
    # random cached prefixes, once per backend: hidden states and written caches agree.
    from prelude.config import ModelConfig
    from prelude.model.attention import get_attention_backend
    from prelude.model.arch.qwen3 import Qwen3ForCausalLM

    _kernels()
    cfg = ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128)
    weights = _tiny_qwen3_weights(cfg, torch.Generator().manual_seed(1))
    rows = [Row(0, 6), Row(9, 1), Row(5, 7), Row(8, 4, own_in_cache=False, publish=True), Row(3, 1)]
    b = make_batch(rows, 4, 2, head_dim=16, block_size=4)
    ids = torch.randint(0, cfg.vocab_size, (sum(r.new for r in rows),), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(r.prefix, r.prefix + r.new) for r in rows])
    results = []
    for name in ("triton", "torch"):
        model = Qwen3ForCausalLM(cfg, weights, torch.float32, attention=get_attention_backend(name))
        caches = [(b.k_cache.clone() * (i + 1), b.v_cache.clone() - i) for i in range(cfg.num_hidden_layers)]
        results.append((model.forward(ids, positions, b.meta, caches), caches))
    (h_t, caches_t), (h_r, caches_r) = results
    assert_close(h_t, h_r)
    for (kt, vt), (kr, vr) in zip(caches_t, caches_r):
        torch.testing.assert_close(kt, kr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vt, vr, atol=1e-5, rtol=1e-5)


def test_model_forward_matches_torch_backend(interp: Run) -> None:
    interp(check_model_forward_matches_torch_backend)


def check_engine_outputs_match_torch_backend() -> None:
    # The whole engine on the triton backend: the runner's packed PrefillTensors feed the
    # kernels (chunked prefill, decode rows, OneShot rows over a cached prefix).
    from prelude.params import PoolingParams, PoolingTask, SamplingParams
    from tests.engine.tiny import hf_tiny_llama, tiny_engine

    _kernels()
    hf = hf_tiny_llama()
    shared = list(range(40, 60))
    outs = []
    for backend in ("triton", "torch"):
        engine = tiny_engine(hf, max_num_batched_tokens=16, attention_backend=backend)
        engine.add_request("g0", shared + [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        engine.add_request("g1", [7, 8, 9, 10, 11], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        got: dict[str, list[int] | tuple[float, ...] | None] = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, [])
                got[o.request_id] += list(o.new_token_ids)  # type: ignore[operator]
        engine.add_request("c", shared + [5], SamplingParams(max_tokens=0),
                           PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3)))
        while engine.has_unfinished():
            for o in engine.step():
                got["c"] = o.scores
        engine.check_integrity()
        outs.append(got)
    tri, ref = outs
    assert tri["g0"] == ref["g0"] and tri["g1"] == ref["g1"]
    torch.testing.assert_close(torch.tensor(tri["c"]), torch.tensor(ref["c"]), atol=1e-4, rtol=1e-4)


def test_engine_outputs_match_torch_backend(interp: Run) -> None:
    interp(check_engine_outputs_match_torch_backend)


def check_replayed_prefill_and_decode_buckets_match_eager() -> None:
    # Token-count buckets for OneShot rows (padding rows of query length 0, padded tokens
    # writing nowhere) and batch buckets for decode, emulated: same answers as eager torch.
    from prelude.executor.graphs import Capture, GraphConfig
    from prelude.params import PoolingParams, PoolingTask, SamplingParams
    from tests.engine.tiny import hf_tiny_llama, tiny_engine

    _kernels()
    hf = hf_tiny_llama()
    results = []
    for backend in ("triton", "torch"):
        engine = tiny_engine(hf, attention_backend=backend)
        if backend == "triton":
            engine.runner.capture_graphs(engine.max_model_len, Capture.EMULATE, GraphConfig(
                decode_batch_sizes=(4,), prefill_token_sizes=(16, 64), max_prefill_rows=4))
        shared = list(range(60, 80))
        for i in range(3):
            engine.add_request(f"c{i}", shared + [i + 1], SamplingParams(max_tokens=0),
                               PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3)))
        engine.add_request("g", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        got: dict[str, object] = {}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] = o.scores if o.scores is not None else \
                    got.get(o.request_id, []) + list(o.new_token_ids)  # type: ignore[operator]
        engine.check_integrity()
        results.append(got)
    tri, ref = results
    assert tri["g"] == ref["g"]
    for i in range(3):
        torch.testing.assert_close(torch.tensor(tri[f"c{i}"]), torch.tensor(ref[f"c{i}"]), atol=1e-4, rtol=1e-4)


def test_replayed_prefill_and_decode_buckets_match_eager(interp: Run) -> None:
    interp(check_replayed_prefill_and_decode_buckets_match_eager)


# --- the kernels directly ------------------------------------------------------------------


def check_decode_split_k(num_splits: int) -> None:
    tri = _kernels()
    lens = [70, 5, 33, 1]  # some splits of the short rows are empty
    b = make_batch([Row(n - 1, 1) for n in lens], 8, 2, block_size=8)
    rows = b.meta.decodes
    out = torch.zeros_like(b.q)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    tri.write_kv(kc, vc, b.k, b.v, b.meta.slot_mapping)
    tri.paged_decode(b.q, kc, vc, out, rows.query_index, rows.block_tables, rows.context_lens, 0.25,
                     num_splits=num_splits, block_n=16)
    ref = TorchAttention().forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.meta, 0.25)
    assert_close(out, ref)


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_decode_split_k(interp: Run, num_splits: int) -> None:
    interp(check_decode_split_k, num_splits)


def check_decode_padded_row_writes_zeros() -> None:
    # A graph-padded decode row (context 0) must produce finite zeros, not NaN.
    tri = _kernels()
    b = make_batch([Row(6, 1), Row(2, 1)], 4, 2)
    rows = b.meta.decodes
    lens = rows.context_lens.clone()
    lens[1] = 0
    for splits in (1, 2):
        out = torch.full_like(b.q, float("nan"))
        tri.paged_decode(b.q, b.k_cache, b.v_cache, out, rows.query_index, rows.block_tables, lens, 0.25,
                         num_splits=splits, block_n=16)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isfinite(out[0]).all()


def test_decode_padded_row_writes_zeros(interp: Run) -> None:
    interp(check_decode_padded_row_writes_zeros)


def check_write_kv_skips_minus_one() -> None:
    tri = _kernels()
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    tri.write_kv(k_cache, v_cache, k, v, torch.tensor([3, -1, 9, -1, 15]))
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[[3, 9, 15]], k[[0, 2, 4]]) and torch.equal(flat_v[[3, 9, 15]], v[[0, 2, 4]])
    written = torch.zeros(16, dtype=torch.bool)
    written[[3, 9, 15]] = True
    assert torch.count_nonzero(flat_k[~written]) == 0 and torch.count_nonzero(flat_v[~written]) == 0


def test_write_kv_skips_minus_one(interp: Run) -> None:
    interp(check_write_kv_skips_minus_one)


def check_decode_num_splits() -> None:
    choose = _kernels().decode_num_splits
    assert choose(64, 8, 100_000) == 1  # enough programs already
    assert choose(1, 8, 100) == 1  # short context: no split
    assert choose(1, 8, 8192) == 16
    for b, h, n in [(1, 2, 1000), (2, 4, 3000), (3, 1, 70_000)]:
        s = choose(b, h, n)
        assert s & (s - 1) == 0 and 1 <= s <= 16


def test_decode_num_splits_is_a_power_of_two(interp: Run) -> None:
    interp(check_decode_num_splits)


# --- segment mask (multi-item scoring) ------------------------------------------------------


def segment_reference(
    q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, prefix: int, segs: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense reference: query i (position prefix+i) sees key j iff j <= prefix+i and key j is
    in the prefix, in segment 0, or in query i's segment."""
    n, ctx = q.shape[0], k_all.shape[0]
    group = q.shape[1] // k_all.shape[1]
    key_seg = torch.cat([torch.zeros(prefix, dtype=segs.dtype), segs])
    causal = torch.arange(ctx)[None, :] <= (torch.arange(n) + prefix)[:, None]
    same = (key_seg[None, :] == 0) | (key_seg[None, :] == segs[:, None])
    kk = k_all.repeat_interleave(group, dim=1).float()
    vv = v_all.repeat_interleave(group, dim=1).float()
    s = torch.einsum("nhd,chd->hnc", q.float(), kk) * scale
    s = s.masked_fill(~(causal & same)[None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", torch.softmax(s, -1), vv)


def check_segment_ids_multi_item_mask(own_in_cache: bool) -> None:
    tri, backend = _kernels(), _backend()
    # row 0: cached prefix 5, then a query segment of 4 tokens and items of 3, 6 and 1 tokens;
    # row 1: no prefix, a query of 2 tokens and items of 5 and 2
    layouts = [(5, [0] * 4 + [1] * 3 + [2] * 6 + [3]), (0, [0] * 2 + [1] * 5 + [2] * 2)]
    b = make_batch([Row(p, len(s), own_in_cache=own_in_cache) for p, s in layouts], 4, 2)
    segs = torch.tensor([x for _, s in layouts for x in s], dtype=torch.int32)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    if b.meta.slot_mapping is not None:
        tri.write_kv(kc, vc, b.k, b.v, b.meta.slot_mapping)
    base = backend.prefill_rows(b.meta.prefills, b.q.device)
    with_segments = tri.PrefillRows(**{**base.__dict__, "segment_ids": segs})
    out = torch.zeros_like(b.q)
    tri.prefill_attention(b.q, b.k, b.v, kc, vc, out, with_segments, 0.25)
    for sl, (prefix, seg) in zip(b.meta.prefills, layouts):
        s, n = sl.query_start, sl.query_len
        cached_k = b.k_cache.index_select(0, sl.block_table).reshape(-1, 2, 16)[:prefix]
        cached_v = b.v_cache.index_select(0, sl.block_table).reshape(-1, 2, 16)[:prefix]
        ref = segment_reference(
            b.q[s : s + n], torch.cat([cached_k, b.k[s : s + n]]), torch.cat([cached_v, b.v[s : s + n]]),
            prefix, torch.tensor(seg, dtype=torch.int32), 0.25,
        )
        assert_close(out[s : s + n], ref)
    # all-zero segment ids give exactly the plain causal mask
    plain, zeros = torch.zeros_like(b.q), torch.zeros_like(b.q)
    tri.prefill_attention(b.q, b.k, b.v, kc, vc, plain, base, 0.25)
    zero_rows = tri.PrefillRows(**{**base.__dict__, "segment_ids": torch.zeros_like(segs)})
    tri.prefill_attention(b.q, b.k, b.v, kc, vc, zeros, zero_rows, 0.25)
    assert torch.equal(plain, zeros)
    assert not torch.allclose(plain, out)


@pytest.mark.parametrize("own_in_cache", [False, True])
def test_segment_ids_multi_item_mask(interp: Run, own_in_cache: bool) -> None:
    interp(check_segment_ids_multi_item_mask, own_in_cache)


# --- bigger sweeps -------------------------------------------------------------------------


def check_random_batch(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    rows = []
    for _ in range(rand(3, 8)):
        kind = rand(0, 3)
        if kind == 0:
            rows.append(Row(rand(0, 60), 1))
        else:
            rows.append(Row(rand(0, 40), rand(2, 40), own_in_cache=kind == 1, publish=bool(rand(0, 2))))
    num_kv = [1, 2, 4][rand(0, 3)]
    b = make_batch(rows, num_kv * [1, 2, 4][rand(0, 3)], num_kv, head_dim=[16, 24, 32][rand(0, 3)],
                   block_size=[1, 4, 8, 16][rand(0, 4)], seed=seed)
    out_t, out_r, caches_t, caches_r = run_both(b)
    assert_close(out_t, out_r)
    assert torch.equal(caches_t[0], caches_r[0])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_random_batches_sweep(interp: Run, seed: int) -> None:
    interp(check_random_batch, seed)


def _released(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """`meta` with each row's table entries for blocks wholly before its first query's
    window set to -1, as a sliding layer's window table holds them once released."""
    from dataclasses import replace

    bs = meta.block_size

    def cut(table: torch.Tensor, first_query: int) -> torch.Tensor:
        out = table.clone()
        out[: max(0, first_query - window + 1) // bs] = -1
        return out

    prefills = tuple(replace(s, block_table=cut(s.block_table, s.context_len - s.query_len)) for s in meta.prefills)
    decodes = meta.decodes
    if decodes is not None:
        tables = torch.stack([cut(t, int(n) - 1) for t, n in zip(decodes.block_tables, decodes.context_lens)])
        decodes = replace(decodes, block_tables=tables)
    return replace(meta, prefills=prefills, decodes=decodes)


WINDOW_ROWS = [Row(0, 40), Row(0, 30, own_in_cache=False), Row(37, 20), Row(25, 9, own_in_cache=False),
               Row(70, 1), Row(9, 1), Row(3, 1)]


def check_window_sees_each_querys_last_positions(window: int, num_splits: int) -> None:
    # A sliding-window layer's rows (fresh prompts longer than the window, chunks and OneShot
    # rows over prefixes, decodes with split-K), their entries before the window released (-1:
    # never read), against the torch backend's masked reference
    tri = _kernels()
    b = make_batch(WINDOW_ROWS, 4, 2, block_size=4, seed=window)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    released = _released(b.meta, window)
    out = _backend().TritonAttention().forward(b.q, b.k, b.v, kc, vc, released, 0.25, window=window)
    ref = TorchAttention().forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.meta, 0.25, window=window)
    assert_close(out, ref)
    rows = released.decodes
    split = torch.zeros_like(b.q)
    tri.paged_decode(b.q, kc, vc, split, rows.query_index, rows.block_tables, rows.context_lens, 0.25,
                     num_splits=num_splits, block_n=16, window=window)
    assert_close(split[rows.query_index], ref[rows.query_index])
    full = TorchAttention().forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.meta, 0.25)
    assert not torch.allclose(full, ref, atol=0.1)  # the window changes the answer


@pytest.mark.parametrize("window,num_splits", [(1, 1), (6, 2), (16, 4)])
def test_window_sees_each_querys_last_positions(interp: Run, window: int, num_splits: int) -> None:
    interp(check_window_sees_each_querys_last_positions, window, num_splits)


# --- CUDA: the compiled kernels -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_kernels_on_cuda(dtype: torch.dtype) -> None:
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("TRITON_INTERPRET is set for this process")
    from prelude.model.attention.triton_backend import TritonAttention

    rows = [Row(0, 37), Row(63, 1), Row(20, 45), Row(700, 1), Row(16, 16, own_in_cache=False, publish=True),
            Row(31, 9, own_in_cache=False), Row(2048, 1)]
    b = make_batch(rows, 16, 4, head_dim=128, block_size=16, dtype=dtype)
    dev = torch.device("cuda")
    meta = b.meta
    meta_dev = AttentionMetadata(meta.slot_mapping.to(dev), meta.prefills, meta.decodes, meta.block_size,
                                 kept_tokens=meta.kept_tokens)
    kc, vc = b.k_cache.to(dev), b.v_cache.to(dev)
    out = TritonAttention().forward(b.q.to(dev), b.k.to(dev), b.v.to(dev), kc, vc, meta_dev, 0.088)
    f = lambda x: x.float()  # noqa: E731
    kr, vr = f(b.k_cache), f(b.v_cache)
    ref = TorchAttention().forward(f(b.q), f(b.k), f(b.v), kr, vr, meta, 0.088)
    assert_close(out.cpu(), ref, atol=2e-2)
    assert torch.equal(kc.cpu().float(), kr) and torch.equal(vc.cpu().float(), vr)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_kernels_take_a_window_on_cuda(dtype: torch.dtype) -> None:
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("TRITON_INTERPRET is set for this process")
    from prelude.model.attention.triton_backend import TritonAttention

    rows = [Row(0, 700), Row(63, 1), Row(900, 45), Row(2048, 1), Row(600, 90, own_in_cache=False), Row(5, 1)]
    b = make_batch(rows, 16, 4, head_dim=128, block_size=16, dtype=dtype)
    dev = torch.device("cuda")
    meta = _released(b.meta, 512)
    meta_dev = AttentionMetadata(meta.slot_mapping.to(dev), meta.prefills, meta.decodes, meta.block_size,
                                 kept_tokens=meta.kept_tokens)
    kc, vc = b.k_cache.to(dev), b.v_cache.to(dev)
    out = TritonAttention().forward(b.q.to(dev), b.k.to(dev), b.v.to(dev), kc, vc, meta_dev, 0.088, window=512)
    f = lambda x: x.float()  # noqa: E731
    ref = TorchAttention().forward(f(b.q), f(b.k), f(b.v), f(b.k_cache), f(b.v_cache), b.meta, 0.088, window=512)
    assert_close(out.cpu(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-4)
