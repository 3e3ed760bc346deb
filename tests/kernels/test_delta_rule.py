"""The C delta rule and causal conv (kernels/cpu/delta_rule.c) against transformers' torch
reference functions, float32 and bf16, off-size head dims: rows of several lengths in one
call, states in the pool (in place) and in scratch, packed items, taps, refusals."""

from __future__ import annotations

import pytest
import torch

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from prelude.kernels.cpu.delta_rule import load_delta_rule  # noqa: E402

KERNELS = load_delta_rule()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler or no AVX2+FMA: the C delta rule is off")

DIMS = [(2, 4, 24, 20), (1, 1, 40, 72), (3, 3, 128, 128), (2, 2, 7, 33)]  # (Hk, Hv, dk, dv)


def _seq(length: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int, decay: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, hk, dk, generator=g).to(dtype)
    k = torch.randn(length, hk, dk, generator=g).to(dtype)
    v = torch.randn(length, hv, dv, generator=g).to(dtype)
    log_decay = -torch.rand(length, hv, generator=g) * decay
    beta = torch.rand(length, hv, generator=g).to(dtype)
    return q, k, v, log_decay, beta


def _reference(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """transformers' recurrent form over one sequence ([L, H, d] inputs), value heads
    sharing key heads in consecutive groups as the model does; (out [L, Hv, dv], state)."""
    hv = v.shape[1]
    rep = hv // q.shape[1]
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    out, final = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                     initial_state=None if state is None else state[None],
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", DIMS)
def test_rows_of_several_lengths_in_one_call_match_the_reference(dtype: torch.dtype,
                                                                 dims: tuple[int, int, int, int]) -> None:
    """A fresh row on scratch, a row continuing its pool slot, a one-token row: one call."""
    hk, hv, dk, dv = dims
    lengths = (70, 150, 1)
    q, k, v, g, beta = _seq(sum(lengths), hk, hv, dk, dv, dtype, seed=1)
    pool = torch.randn(3, hv, dk, dv, generator=torch.Generator().manual_seed(2)) * 0.1
    before = pool.clone()
    scratch = torch.full((1, hv, dk, dv), float("nan"))  # the kernel must not read it before writing
    rows = torch.tensor([[0, 70, -2, -1], [70, 150, 2, 2], [220, 1, 0, 0]])
    out = KERNELS.delta_rule(q, k, v, g, beta.float(), rows, pool, scratch, dk**-0.5)
    assert out.dtype == dtype and out.shape == (221, hv, dv)
    tol = _tol(dtype)
    for (start, length, dst, src), got_state in ((rows[0].tolist(), scratch[0]), (rows[1].tolist(), pool[2]),
                                                (rows[2].tolist(), pool[0])):
        span = slice(start, start + length)
        init = None if src == -1 else before[src]
        ref_out, ref_state = _reference(q[span], k[span], v[span], g[span], beta[span], init)
        assert torch.allclose(out[span].float(), ref_out.float(), atol=tol, rtol=tol)
        assert torch.allclose(got_state, ref_state, atol=1e-4, rtol=1e-4)
    assert torch.equal(pool[1], before[1])  # a slot no row names is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_reference_agrees_on_a_long_prompt(dtype: torch.dtype) -> None:
    q, k, v, g, beta = _seq(300, 2, 4, 64, 48, dtype, seed=3)
    rows = torch.tensor([[0, 300, -2, -1]])
    scratch = torch.empty(1, 4, 64, 48)
    out = KERNELS.delta_rule(q, k, v, g, beta.float(), rows, None, scratch, 64**-0.5)
    rep = 2
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(
        q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None], v[None], g[None], beta[None],
        initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref_out[0].float(), atol=tol, rtol=tol)
    assert torch.allclose(scratch[0], ref_state[0], atol=1e-4, rtol=1e-4)


def test_decode_rows_update_their_slots_in_place() -> None:
    hk, hv, dk, dv = 2, 4, 24, 20
    q, k, v, g, beta = _seq(3, hk, hv, dk, dv, torch.float32, seed=4)
    pool = torch.randn(5, hv, dk, dv, generator=torch.Generator().manual_seed(5))
    before = pool.clone()
    rows = torch.tensor([[0, 1, 4, 4], [1, 1, 1, 1], [2, 1, 2, 2]])
    out = KERNELS.delta_rule(q, k, v, g, beta, rows, pool, None, dk**-0.5)
    for token, slot in ((0, 4), (1, 1), (2, 2)):
        span = slice(token, token + 1)
        ref_out, ref_state = _reference(q[span], k[span], v[span], g[span], beta[span], before[slot])
        assert torch.allclose(out[span], ref_out, atol=1e-5)
        assert torch.allclose(pool[slot], ref_state, atol=1e-5)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[3], before[3])


def test_packed_items_each_continue_the_shared_state() -> None:
    hk, hv, dk, dv = 1, 2, 16, 16
    q, k, v, g, beta = _seq(12, hk, hv, dk, dv, torch.float32, seed=6)
    # shared part [0, 6), items [6, 9) and [9, 12), each from the shared part's end
    rows = torch.tensor([[0, 6, -2, -1], [6, 3, -3, -2], [9, 3, -4, -2]])
    scratch = torch.empty(3, hv, dk, dv)
    out = KERNELS.delta_rule(q, k, v, g, beta, rows, None, scratch, dk**-0.5)
    _, shared_state = _reference(q[:6], k[:6], v[:6], g[:6], beta[:6], None)
    assert torch.allclose(scratch[0], shared_state, atol=1e-5)
    for (lo, hi), place in (((6, 9), 1), ((9, 12), 2)):
        ref_out, ref_state = _reference(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], shared_state)
        assert torch.allclose(out[lo:hi], ref_out, atol=1e-5)
        assert torch.allclose(scratch[place], ref_state, atol=1e-5)


def test_taps_give_the_state_at_a_position_inside_a_row() -> None:
    hk, hv, dk, dv = 2, 2, 32, 40
    q, k, v, g, beta = _seq(100, hk, hv, dk, dv, torch.float32, seed=7)
    rows = torch.tensor([[0, 40, -2, -1], [40, 60, -3, -1]])
    taps = torch.tensor([[15, -4], [63, -5], [63, -6]])  # after token 15 of row 0, after token 23 of row 1 (twice)
    scratch = torch.empty(5, hv, dk, dv)
    KERNELS.delta_rule(q, k, v, g, beta, rows, None, scratch, dk**-0.5, taps)
    _, at_15 = _reference(q[:16], k[:16], v[:16], g[:16], beta[:16], None)
    _, at_63 = _reference(q[40:64], k[40:64], v[40:64], g[40:64], beta[40:64], None)
    assert torch.allclose(scratch[2], at_15, atol=1e-5)
    assert torch.equal(scratch[3], scratch[4]) and torch.allclose(scratch[3], at_63, atol=1e-5)


def test_strong_decays_match_the_reference() -> None:
    """Log decays down to -80 per token: products pass through the subnormal range."""
    q, k, v, _, beta = _seq(130, 2, 4, 24, 20, torch.float32, seed=8)
    g = -torch.rand(130, 4, generator=torch.Generator().manual_seed(9)) * 80
    scratch = torch.empty(1, 4, 24, 20)
    out = KERNELS.delta_rule(q, k, v, g, beta, torch.tensor([[0, 130, -2, -1]]), None, scratch, 24**-0.5)
    ref_out, ref_state = _reference(q, k, v, g, beta, None)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(scratch[0], ref_state, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", [12, 64, 200])
def test_the_conv_matches_the_reference_across_rows_states_and_taps(dtype: torch.dtype, channels: int) -> None:
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(40, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, 4, generator=gen).to(dtype)
    ref = hf.causal_conv1d_fn(x[:30].T.float()[None], weight.float(), None, activation="silu")[0].T
    # one sequence [0, 30) in three rows through slot 1 (fresh, then continued), a decode-like
    # one-token row of another sequence from slot 0, a tap inside the first row
    pool = torch.randn(2, channels, 3, generator=gen).to(dtype)
    slot0 = pool[0].clone()
    rows = torch.tensor([[0, 13, 1, -1], [13, 16, 1, 1], [29, 1, 1, 1], [35, 1, 0, 0]])
    scratch = torch.empty(1, channels, 3, dtype=dtype)
    out = KERNELS.conv(x, weight, rows, pool, scratch, torch.tensor([[9, -2]]))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out[:30].float(), ref, atol=tol, rtol=tol)
    assert torch.equal(pool[1], x[27:30].T)  # the last three inputs, oldest first
    assert torch.equal(scratch[0], x[7:10].T)
    window = torch.cat([slot0.float(), x[35:36].T.float()], dim=1)
    expect = torch.nn.functional.silu((window * weight.float()).sum(-1).to(dtype).float())
    assert torch.allclose(out[35].float(), expect, atol=tol, rtol=tol)
    assert torch.equal(pool[0], torch.cat([slot0[:, 1:], x[35:36].T], dim=1))


def test_the_conv_reads_strided_rows() -> None:
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(20, 50, generator=gen)
    x = wide[:, 5:37]  # a slice of a projection's output: row stride 50
    weight = torch.randn(32, 4, generator=gen)
    out = KERNELS.conv(x, weight, torch.tensor([[0, 20, -2, -1]]), None, torch.empty(1, 32, 3))
    ref = hf.causal_conv1d_fn(x.T.contiguous()[None], weight, None, activation="silu")[0].T
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("rows, taps", [
    ([[0, 5, 3, -1]], None),  # slot 3 of a pool of 2
    ([[0, 5, -3, -1]], None),  # scratch entry 1 of 1
    ([[0, 5, -1, -1]], None),  # a zero state is no destination
    ([[0, 9, -2, -1]], None),  # past the tokens
    ([[0, 5, -2, -1]], [[3, -2], [1, -2]]),  # taps out of order
])
def test_bad_rows_or_taps_are_refused(rows: list[list[int]], taps: list[list[int]] | None) -> None:
    q, k, v, g, beta = _seq(6, 1, 1, 8, 8, torch.float32, seed=12)
    pool, scratch = torch.zeros(2, 1, 8, 8), torch.zeros(1, 1, 8, 8)
    tap_table = None if taps is None else torch.tensor(taps)
    with pytest.raises(ValueError, match="refused"):
        KERNELS.delta_rule(q, k, v, g, beta, torch.tensor(rows), pool, scratch, 1.0, tap_table)
    with pytest.raises(ValueError, match="refused"):
        KERNELS.conv(torch.zeros(6, 4), torch.zeros(4, 4), torch.tensor(rows), torch.zeros(2, 4, 3),
                     torch.zeros(1, 4, 3), tap_table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 20])
def test_the_gated_norm_matches_the_eager_ops(dtype: torch.dtype, d: int) -> None:
    from prelude.model.layers.gated_delta_net import gated_rms_norm

    gen = torch.Generator().manual_seed(13)
    x = torch.randn(37, 3, d, generator=gen).to(dtype)
    wide = torch.randn(37, 3 * d + 5, generator=gen).to(dtype)
    gate = wide[:, 2:2 + 3 * d].reshape(37, 3, d)  # a strided slice, as z is of the projection
    weight = (1 + torch.randn(d, generator=gen) * 0.3).to(dtype)
    got = KERNELS.gated_rms_norm(x, weight, gate, 1e-6)
    want = gated_rms_norm(x, weight, gate, 1e-6).reshape(37, 3 * d)
    # float32: the sum's order and SiLU's exp; bf16: the same, seen as a rare one-ulp flip
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
