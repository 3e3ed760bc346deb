"""The fused-MoE Triton kernel (kernels/triton/fused_moe.py) against torch's grouped experts
(model/layers/moe.py with own_kernels=False), on the CPU under TRITON_INTERPRET=1
(tests/model/triton_interp.py) at tiny off-size widths, in float32 and bf16; the `gpu`
tests run the compiled kernel on CUDA, alone and as a Qwen3-MoE block's path."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from prelude.model.layers.moe import SparseMoe
from tests.model.triton_interp import Run, interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _kernel() -> ModuleType:
    return interpreted("prelude.kernels.triton.fused_moe")


def _case(t: int, e: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
          device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(e, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return tuple(v.to(device) for v in (x, gate_up, down, weights, experts))


def _torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
           experts: torch.Tensor) -> torch.Tensor:
    router = torch.zeros(gate_up.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    block = SparseMoe(router, gate_up, down, experts.shape[1], False, F.silu, own_kernels=False)
    return block.run_experts(x, weights.to(x.dtype), experts)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2e-6 if want.dtype == torch.float32 else 2e-2
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


def check_align_by_expert() -> None:
    k = _kernel()
    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 0]])
    slots, block_expert = k.align_by_expert(experts, 5, 4)
    s = experts.numel()
    assert slots.numel() == block_expert.numel() * 4
    assert block_expert.numel() == -(-s // 4) + 5  # the bound: shapes follow T, k and E only
    used = block_expert[block_expert >= 0].tolist()
    assert used == [0, 1, 2, 3, 3]  # expert 4 has no block; 3 has five slots: two blocks
    for b, e in enumerate(used):
        run = slots[4 * b:4 * b + 4]
        real = run[run < s]
        assert (experts.reshape(-1)[real] == e).all()
        assert real.tolist() == sorted(real.tolist())  # token order within an expert
    assert sorted(slots[slots < s].tolist()) == list(range(s))  # every slot once


def check_matches_torch(dtype_name: str) -> None:
    k, dtype = _kernel(), getattr(torch, dtype_name)
    # widths off every block size; one token; experts no token chose; more rows than a block
    for t, e, top, hidden, inter in ((1, 4, 2, 40, 20), (7, 6, 3, 33, 17), (21, 3, 3, 24, 70)):
        case = _case(t, e, top, hidden, inter, dtype, t)
        _close(k.fused_moe(*case), _torch(*case))


def test_align_by_expert(interp: Run) -> None:
    interp(check_align_by_expert)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_moe_matches_torch_under_the_interpreter(interp: Run, dtype: str) -> None:
    interp(check_matches_torch, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 16, 300])
def test_fused_moe_on_cuda_matches_torch(dtype: torch.dtype, t: int) -> None:
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("TRITON_INTERPRET is set for this process")
    from prelude.kernels.triton.fused_moe import fused_moe

    case = _case(t, 32, 4, 520, 200, dtype, t, device="cuda")  # widths off the block sizes
    _close(fused_moe(*case).cpu(), _torch(*case).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_block_takes_the_triton_path_and_reads_only_chosen_experts() -> None:
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("TRITON_INTERPRET is set for this process")
    x, gate_up, down, _, _ = _case(5, 16, 2, 64, 32, torch.bfloat16, 3, device="cuda")
    router = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    block = SparseMoe(router, gate_up, down, 2, True, F.silu)
    assert block.path == "triton"
    want = block(x)
    chosen = set(block.route(x)[1].flatten().tolist())
    for e in set(range(16)) - chosen:
        gate_up[e].fill_(float("nan"))
        down[e].fill_(float("nan"))
    assert torch.equal(block(x), want)
    weights, experts = block.route(x)
    _close(want.cpu(), _torch(x, gate_up, down, weights, experts).cpu())
