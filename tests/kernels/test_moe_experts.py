"""The CPU MoE kernel (moe_experts.c) against torch: the chosen experts' gated MLPs summed
with the router's weights, at off-size widths (hidden and intermediate not multiples of
16 or 32, odd ones too), in float32 and bf16; experts no token chose, one expert chosen by
every token, tied weights; a row's bits whatever shares its call and whatever the thread
count; bad expert ids refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prelude.kernels.cpu.moe_experts import load_moe_experts
from prelude.model.layers.moe import SparseMoe

KERNEL = load_moe_experts()
DTYPES = [d for d in (torch.float32, torch.bfloat16) if KERNEL is not None and KERNEL.takes(d)]
needs_kernel = pytest.mark.skipif(not DTYPES, reason="no AVX-512 here (or no C compiler): torch runs the experts")


def _experts(e: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(e, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return gate_up, down


def _torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
           experts: torch.Tensor) -> torch.Tensor:
    """torch's grouped path (F.linear an expert, in x's dtype): what the kernel replaces."""
    router = torch.zeros(gate_up.shape[0], x.shape[1], dtype=x.dtype)
    block = SparseMoe(router, gate_up, down, experts.shape[1], False, F.silu, own_kernels=False)
    return block.run_experts(x, weights.to(x.dtype), experts)


def _routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) + 0.1
    return weights / weights.sum(-1, keepdim=True), experts


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    # float32: a sum order apart; bf16: a value rounded the other way now and then (the
    # roundings between the GEMMs are the same, their inputs' last bits may differ)
    tol = 2e-6 if want.dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,inter", [(64, 32), (40, 20), (45, 37), (33, 17), (31, 50), (100, 9), (17, 96)])
@pytest.mark.parametrize("tokens", [1, 3, 11, 40])
def test_matches_torch_at_off_size_widths(dtype: torch.dtype, hidden: int, inter: int, tokens: int) -> None:
    assert KERNEL is not None
    e, k = 6, 2
    gate_up, down = _experts(e, hidden, inter, dtype, hidden * 100 + inter)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    weights, experts = _routing(tokens, e, k, tokens + hidden)
    got = KERNEL.forward(x, weights, experts, KERNEL.pack(gate_up, down))
    _assert_close(got, _torch(x, gate_up, down, weights, experts))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_with_zero_tokens_and_one_chosen_by_all(dtype: torch.dtype) -> None:
    """12 experts, only 0, 5 and 11 chosen (every token has 5); top-3, 30 tokens: whole
    4-row tiles and a tail for the experts that run, none for the rest."""
    assert KERNEL is not None
    gate_up, down = _experts(12, 72, 40, dtype, 1)
    x = torch.randn(30, 72, generator=torch.Generator().manual_seed(2)).to(dtype)
    experts = torch.tensor([[5, 0, 11] if t % 2 else [11, 5, 0] for t in range(30)])
    weights = torch.rand(30, 3, generator=torch.Generator().manual_seed(3))
    packed = KERNEL.pack(gate_up, down)
    got = KERNEL.forward(x, weights, experts, packed)
    _assert_close(got, _torch(x, gate_up, down, weights, experts))
    # the other experts' packed weights are never read
    for copy in (packed.gate_up, packed.down):
        rows = copy.view(12, -1)
        for e in set(range(12)) - {0, 5, 11}:
            rows[e].view(torch.uint8).fill_(0xFF)  # NaN in float32 and in bf16
    assert torch.equal(KERNEL.forward(x, weights, experts, packed), got)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_experts_and_weights_sum_in_expert_order(dtype: torch.dtype) -> None:
    """Experts 2 and 6 alike and chosen with equal weights: both orders of a token's top-k
    give the same sums (ascending expert order either way), equal to torch's."""
    assert KERNEL is not None
    gate_up, down = _experts(8, 48, 24, dtype, 4)
    gate_up[6], down[6] = gate_up[2], down[2]
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(5)).to(dtype)
    weights = torch.full((9, 3), 0.25)
    weights[:, 0] = 0.5
    ab = torch.tensor([[1, 2, 6]] * 9)
    ba = torch.tensor([[1, 6, 2]] * 9)
    packed = KERNEL.pack(gate_up, down)
    got = KERNEL.forward(x, weights, ab, packed)
    assert torch.equal(KERNEL.forward(x, weights, ba, packed), got)
    _assert_close(got, _torch(x, gate_up, down, weights, ab))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_alone_batched_and_at_any_thread_count(dtype: torch.dtype) -> None:
    assert KERNEL is not None
    gate_up, down = _experts(8, 200, 72, dtype, 6)
    x = torch.randn(37, 200, generator=torch.Generator().manual_seed(7)).to(dtype)
    weights, experts = _routing(37, 8, 3, 8)
    packed = KERNEL.pack(gate_up, down)
    together = KERNEL.forward(x, weights, experts, packed)
    for a, b in ((0, 1), (36, 37), (3, 10), (10, 30)):
        assert torch.equal(KERNEL.forward(x[a:b], weights[a:b], experts[a:b], packed), together[a:b])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(KERNEL.forward(x, weights, experts, packed), together)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_strided_rows_are_read_in_place() -> None:
    assert KERNEL is not None
    dtype = DTYPES[-1]
    gate_up, down = _experts(4, 40, 20, dtype, 9)
    wide = torch.randn(5, 64).to(dtype)
    x = wide[:, 10:50]
    weights, experts = _routing(5, 4, 2, 10)
    packed = KERNEL.pack(gate_up, down)
    assert torch.equal(KERNEL.forward(x, weights, experts, packed),
                       KERNEL.forward(x.contiguous(), weights, experts, packed))


@needs_kernel
def test_bad_arguments_are_refused() -> None:
    assert KERNEL is not None
    dtype = DTYPES[0]
    gate_up, down = _experts(4, 32, 16, dtype, 11)
    packed = KERNEL.pack(gate_up, down)
    x = torch.randn(2, 32).to(dtype)
    weights = torch.full((2, 2), 0.5)
    with pytest.raises(RuntimeError, match="refused"):
        KERNEL.forward(x, weights, torch.tensor([[0, 4], [1, 2]]), packed)  # expert 4 of 4
    with pytest.raises(RuntimeError, match="refused"):
        KERNEL.forward(x, weights, torch.tensor([[0, -1], [1, 2]]), packed)
    with pytest.raises(ValueError):
        KERNEL.forward(torch.randn(2, 31).to(dtype), weights, torch.tensor([[0, 1], [1, 2]]), packed)
    with pytest.raises(ValueError):
        KERNEL.pack(gate_up, down[:, :, :15])
    assert KERNEL.forward(x[:0], weights[:0], torch.zeros(0, 2, dtype=torch.int64), packed).shape == (0, 32)
