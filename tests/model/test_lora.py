"""LoRA adapters (model/lora.py) vs PEFT on random-weight tiny models (float32)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from prelude.config import ExecutorConfig, ModelConfig
from prelude.executor.runner import ModelRunner, fused_segments_for
from prelude.forward_batch import BatchRow
from prelude.kv.kv_manager import KVCacheManager
from prelude.model.layers.decoder_segments import EAGER_SEGMENTS
from prelude.model.layers.linear import prepack_enabled
from prelude.model.lora.adapters import FUSED, TARGETS, LoraBatch, LoraError, LoraSlots, LoraStep, _pieces, read_adapter
from prelude.kernels.cpu.lora_cpu import load_lora_kernel
from prelude.model.registry import config_for

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def hf_base(kind: str, seed: int = 0) -> "transformers.PreTrainedModel":
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=False))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, tie_word_embeddings=True))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


def save_adapter(kind: str, path: Path, seed: int, targets: tuple[str, ...] = TARGETS, r: int = 8,
                 alpha: float = 16, rslora: bool = False) -> "transformers.PreTrainedModel":
    """A random PEFT adapter for hf_base(kind) saved at `path`; returns PEFT's merged model."""
    base = hf_base(kind)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                          init_lora_weights=False)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return model.merge_and_unload().eval()


def runner_for(kind: str, num_blocks: int = 64) -> tuple[ModelRunner, KVCacheManager, ModelConfig]:
    hf = hf_base(kind)
    config = config_for(hf.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    runner = ModelRunner.create(config, weights, ExecutorConfig(device="cpu", dtype="float32"), 4)
    runner.allocate_kv_cache(num_blocks)
    return runner, KVCacheManager(num_blocks, 4), config


def logits_of(runner: ModelRunner, rows: list[BatchRow], row_slots: list[int], slots: LoraSlots,
              segments=EAGER_SEGMENTS, all_slots: bool = False) -> list[torch.Tensor]:
    """`all_slots`: the masked all-slots path (few tokens), else the grouped one."""
    inputs = runner.inputs.paged(tuple(rows))
    batch = LoraBatch.build(row_slots, [len(r.token_ids) for r in rows], "cpu", slots.num_slots if all_slots else 0)
    assert batch is None or (batch.one_hot is not None) == all_slots
    step = None if batch is None else LoraStep(slots, batch)
    hidden = runner.model.forward(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches,
                                  segments=segments, lora=step)
    logits = runner.model.compute_logits(hidden)
    return [logits[s : s + len(r.token_ids)] for s, r in zip(inputs.starts, rows)]


def hf_logits(model: "transformers.PreTrainedModel", ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind,targets,rslora", [
    ("llama", TARGETS, False),
    ("qwen2", ("q_proj", "v_proj", "down_proj"), True),
    ("qwen3", ("k_proj", "o_proj", "gate_proj", "up_proj"), False),
])
def test_adapter_logits_equal_peft_merged(tmp_path: Path, kind: str, targets: tuple[str, ...], rslora: bool) -> None:
    merged = save_adapter(kind, tmp_path / "a", seed=3, targets=targets, r=8, rslora=rslora)
    runner, kv, config = runner_for(kind)
    adapter = read_adapter("a", tmp_path / "a", config, max_rank=16)
    slots = LoraSlots(config, num_slots=2, max_rank=16, dtype=torch.float32, device="cpu")
    slots.load(1, adapter)
    segment_sets = [EAGER_SEGMENTS] + [s for s in [fused_segments_for(runner.model, runner.config)] if s]
    prompt = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    want = hf_logits(merged, prompt)
    for n, (segments, all_slots) in enumerate((s, a) for s in segment_sets for a in (False, True)):
        assert kv.allocate(f"r{n}", len(prompt))
        (got,) = logits_of(runner, [BatchRow(f"r{n}", prompt, 0, kv.block_table(f"r{n}"), None)], [1], slots, segments,
                           all_slots)
        assert (got - want).abs().max().item() <= 1e-4, (segments.label, all_slots)
        assert (got - hf_logits(hf_base(kind), prompt)).abs().max().item() > 1e-2  # the adapter does change them


def test_mixed_batch_of_three_adapters_and_base_equals_each_alone(tmp_path: Path) -> None:
    runner, kv, config = runner_for("llama")
    slots = LoraSlots(config, num_slots=4, max_rank=16, dtype=torch.float32, device="cpu")
    for i, (r, targets) in enumerate([(4, TARGETS), (16, ("q_proj", "up_proj")), (8, ("v_proj", "down_proj"))]):
        save_adapter("llama", tmp_path / str(i), seed=10 + i, targets=targets, r=r)
        slots.load(i + 1, read_adapter(str(i), tmp_path / str(i), config, max_rank=16))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 9, 3, 7, 6)]
    row_slots = [2, -1, 1, 3, 2]  # adapter 2's rows are apart: the grouped path takes an index
    alone = []
    for i, (p, s) in enumerate(zip(prompts, row_slots)):
        assert kv.allocate(f"alone{i}", len(p))
        (lg,) = logits_of(runner, [BatchRow(f"alone{i}", p, 0, kv.block_table(f"alone{i}"), None)], [s], slots)
        alone.append(lg)
    rows = []
    for i, p in enumerate(prompts):
        assert kv.allocate(f"mix{i}", len(p))
        rows.append(BatchRow(f"mix{i}", p, 0, kv.block_table(f"mix{i}"), None))
    mixed = logits_of(runner, rows, row_slots, slots)
    for a, m in zip(alone, mixed):
        assert (a - m).abs().max().item() <= 1e-4
    rows_again = []
    for i, p in enumerate(prompts):  # the same rows through the masked all-slots path
        assert kv.allocate(f"again{i}", len(p))
        rows_again.append(BatchRow(f"again{i}", p, 0, kv.block_table(f"again{i}"), None))
    for a, m in zip(alone, logits_of(runner, rows_again, row_slots, slots, all_slots=True)):
        assert (a - m).abs().max().item() <= 1e-4
    if slots.kernel is not None:  # ...and without the C kernel: the oneDNN (or aten) all-slots path
        slots.kernel, slots.prepack = None, prepack_enabled(torch.float32, torch.device("cpu"))
        rows_third = []
        for i, p in enumerate(prompts):
            assert kv.allocate(f"third{i}", len(p))
            rows_third.append(BatchRow(f"third{i}", p, 0, kv.block_table(f"third{i}"), None))
        for a, m in zip(alone, logits_of(runner, rows_third, row_slots, slots, all_slots=True)):
            assert (a - m).abs().max().item() <= 1e-4
        slots.kernel = load_lora_kernel()
    # ...and a decode step of the same rows (one token each, interleaved adapters)
    decode_rows = []
    for i, (p, lg) in enumerate(zip(prompts, mixed)):
        tok = int(lg[-1].argmax())
        assert kv.allocate(f"mix{i}", len(p) + 1)
        decode_rows.append(BatchRow(f"mix{i}", [tok], len(p), kv.block_table(f"mix{i}"), None))
    stepped = logits_of(runner, decode_rows, row_slots, slots, all_slots=True)
    for i, (p, lg) in enumerate(zip(prompts, mixed)):
        assert kv.allocate(f"full{i}", len(p) + 1)
        full = p + [int(lg[-1].argmax())]
        (ref,) = logits_of(runner, [BatchRow(f"full{i}", full, 0, kv.block_table(f"full{i}"), None)],
                           [row_slots[i]], slots)
        assert (stepped[i][-1] - ref[-1]).abs().max().item() <= 1e-4


def test_bf16_mixed_step_through_the_c_kernels_equals_the_torch_paths(tmp_path: Path) -> None:
    """bf16 (what a CPU serves by default): a prefill-sized mixed step through the grouped C
    kernel and a decode-sized one through the per-token kernel equal torch's grouped and
    all-slots paths within bf16 rounding, far closer than the adapters' own effect."""
    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("no C compiler or no AVX2+FMA here")
    hf = hf_base("llama")
    config = config_for(hf.config.to_dict())
    runner = ModelRunner.create(config, {k: v.detach().clone() for k, v in hf.state_dict().items()},
                                ExecutorConfig(device="cpu", dtype="bfloat16"), 4)
    runner.allocate_kv_cache(128)
    kv = KVCacheManager(128, 4)
    slots = LoraSlots(config, num_slots=3, max_rank=16, dtype=torch.bfloat16, device="cpu")
    for i, (r, targets) in enumerate([(16, TARGETS), (5, ("q_proj", "v_proj", "up_proj", "down_proj"))]):
        save_adapter("llama", tmp_path / str(i), seed=20 + i, targets=targets, r=r)
        slots.load(i + 1, read_adapter(str(i), tmp_path / str(i), config, max_rank=16))
    gen = torch.Generator().manual_seed(7)
    row_slots = [2, -1, 1, 2]  # adapter 2's rows are apart
    # the grouped kernel's 54 tokens, the per-token one's 14
    prompt_sets = {all_slots: [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lens]
                   for all_slots, lens in ((False, (21, 9, 13, 11)), (True, (5, 3, 4, 2)))}

    def run(name: str, all_slots: bool, c_kernel: bool, slot_of: list[int]) -> list[torch.Tensor]:
        slots.kernel = kernel if c_kernel else None
        rows = []
        for i, p in enumerate(prompt_sets[all_slots]):
            assert kv.allocate(f"{name}{i}", len(p))
            rows.append(BatchRow(f"{name}{i}", p, 0, kv.block_table(f"{name}{i}"), None))
        return [lg.float() for lg in logits_of(runner, rows, slot_of, slots, all_slots=all_slots)]

    try:
        for all_slots in (False, True):
            base = run(f"base{all_slots}", all_slots, True, [-1] * 4)
            want = run(f"torch{all_slots}", all_slots, False, row_slots)
            got = run(f"c{all_slots}", all_slots, True, row_slots)
            for i, (g, w, b) in enumerate(zip(got, want, base)):
                diff, effect = (g - w).abs().max().item(), (w - b).abs().max().item()
                assert diff <= 0.1 and (row_slots[i] < 0 or effect > max(5 * diff, 0.3)), (all_slots, i, diff, effect)
    finally:
        slots.kernel = kernel


def test_no_adapter_is_the_plain_forward(tmp_path: Path) -> None:
    runner, kv, config = runner_for("llama")
    assert LoraBatch.build([-1, -1], [3, 1], "cpu") is None
    slots = LoraSlots(config, num_slots=1, max_rank=8, dtype=torch.float32, device="cpu")
    p = [1, 2, 3, 4, 5]
    assert kv.allocate("x", len(p))
    (plain,) = logits_of(runner, [BatchRow("x", p, 0, kv.block_table("x"), None)], [-1], slots)
    (zero_slot,) = logits_of(runner, [BatchRow("x", p, 0, kv.block_table("x"), None)], [0], slots)
    assert torch.equal(plain, zero_slot) or (plain - zero_slot).abs().max().item() <= 1e-6


def test_bad_adapters_say_why(tmp_path: Path) -> None:
    _, _, config = runner_for("llama")
    with pytest.raises(LoraError, match="lacks"):
        read_adapter("x", tmp_path, config, 16)
    save_adapter("llama", tmp_path / "big", seed=1, r=32)
    with pytest.raises(LoraError, match="over --max-lora-rank 16"):
        read_adapter("x", tmp_path / "big", config, 16)
    save_adapter("qwen3", tmp_path / "other", seed=1, targets=("q_proj",))  # head_dim 32: q is 128 wide
    with pytest.raises(LoraError, match="do not fit"):
        read_adapter("x", tmp_path / "other", config, 16)
    save_adapter("llama", tmp_path / "lm", seed=1, targets=("q_proj",))
    cfg = json.loads((tmp_path / "lm" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "embed_tokens"]
    (tmp_path / "lm" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match="unknown target module.*embed_tokens"):
        read_adapter("x", tmp_path / "lm", config, 16)


def test_slot_bytes_are_counted_before_building() -> None:
    config = config_for(hf_base("qwen3").config.to_dict())
    slots = LoraSlots(config, num_slots=3, max_rank=4, dtype=torch.float32, device="cpu")
    assert slots.nbytes == LoraSlots.bytes_for(config, 3, 4, torch.float32) > 0


def check_triton_delta(dtype_name: str) -> None:
    """The Triton kernel pair equals the CPU's grouped matmul (run under the interpreter)."""
    from tests.model.triton_interp import interpreted

    kernels = interpreted("prelude.kernels.triton.lora")
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    slots, n_in, rank, n_out = 3, 40, 24, 70  # none a power of two: the tiles' masks are exercised
    a = (torch.randn(slots, n_in, rank, generator=gen) * 0.3).to(dtype)  # LoraSlots' layout
    b = (torch.randn(slots, rank, n_out, generator=gen) * 0.3).to(dtype)
    row_slots, row_lens = [2, -1, 0, 2, 1], [3, 2, 1, 4, 1]
    tokens = sum(row_lens)
    x = torch.randn(tokens, n_in, generator=gen).to(dtype)
    base = torch.randn(tokens, n_out, generator=gen).to(dtype)
    batch = LoraBatch.build(row_slots, row_lens, "cpu")
    assert batch is not None and batch.one_hot is None
    want = batch.delta_into(base.clone().float(), x.float(), a.float(), b.float())
    all_slots = LoraBatch.build(row_slots, row_lens, "cpu", slots)
    assert all_slots is not None and all_slots.one_hot is not None
    torch.testing.assert_close(all_slots.delta_into(base.clone().float(), x.float(), a.float(), b.float()), want)
    got = kernels.lora_delta_(base.clone(), x, a, b, batch.token_slots)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[3:5], base[3:5])  # base rows are left as they were


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_triton_delta_equals_grouped_matmul(interp, dtype_name: str) -> None:
    interp(check_triton_delta, dtype_name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_equals_the_grouped_matmul(dtype: torch.dtype) -> None:
    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("no C compiler or no AVX2+FMA here")
    gen = torch.Generator().manual_seed(3)
    slots, n_in, width, n_out = 3, 40, 24, 70
    a = (torch.randn(slots, n_in, width, generator=gen) * 0.3).to(dtype)
    b = (torch.randn(slots, width, n_out, generator=gen) * 0.3).to(dtype)
    row_slots = [2, -1, 0, 2, 1]
    x = torch.randn(5, n_in, generator=gen).to(dtype)
    base = torch.randn(5, n_out, generator=gen).to(dtype)
    batch = LoraBatch.build(row_slots, [1] * 5, "cpu")
    assert batch is not None
    want = batch.delta_into(base.clone().float(), x.float(), a.float(), b.float())
    got = kernel.delta_(base.clone(), x, a, b, batch.token_slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output rounded once, after the sum
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[1], base[1])  # the base row is left as it was
    assert not kernel.fits(x, torch.zeros(slots, n_in, 2048, dtype=dtype), torch.zeros(slots, 2048, n_out, dtype=dtype))


@pytest.mark.parametrize("dtype, rank, n_in", [(torch.float32, 4, 16), (torch.bfloat16, 4, 16), (torch.bfloat16, 5, 71)])
def test_c_kernel_reads_only_the_diagonal_blocks_of_a_fused_projection(dtype: torch.dtype, rank: int,
                                                                        n_in: int) -> None:
    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("no C compiler or no AVX2+FMA here")
    gen = torch.Generator().manual_seed(4)
    outs = [12, 5, 7]  # three targets, as q/k/v
    a = torch.randn(2, n_in, 3 * rank, generator=gen).to(dtype)
    b = torch.zeros(2, 3 * rank, sum(outs), dtype=dtype)
    for j, off in enumerate((0, 12, 17)):
        b[:, j * rank : (j + 1) * rank, off : off + outs[j]] = torch.randn(2, rank, outs[j], generator=gen)
    x, base = torch.randn(3, n_in, generator=gen).to(dtype), torch.randn(3, sum(outs), generator=gen).to(dtype)
    slots = torch.tensor([1, 0, -1])
    want = kernel.delta_(base.clone(), x, a, b, slots)  # all columns of every row block
    cols = torch.tensor([0, 12, 17, 24], dtype=torch.int32)
    torch.testing.assert_close(kernel.delta_(base.clone(), x, a, b, slots, cols), want)
    b[:, 0:rank, 12:] = 1e6  # off-diagonal: never read
    torch.testing.assert_close(kernel.delta_(base.clone(), x, a, b, slots, cols), want)


def test_avx2_build_of_the_c_kernel_keeps_its_portable_bf16_path() -> None:
    """Built for AVX2+FMA only (an AVX2-only CPU), the bf16 per-token kernel takes its
    portable path, equal to the AVX512-BF16 one within bf16 rounding, and the grouped
    kernel says it is not there (prefill keeps the torch grouped path)."""
    import ctypes

    from prelude.kernels.cpu import lora_cpu
    from prelude.kernels.cpu import native_lib

    native = load_lora_kernel()
    if native is None:
        pytest.skip("no C compiler or no AVX2+FMA here")
    avx2 = lora_cpu.LoraKernel(ctypes.CDLL(str(lora_cpu.build(native_lib.AVX2_FLAGS))))
    assert not avx2.grouped  # (nor the decode kernel on StreamLayout copies: no copy is made)
    gen = torch.Generator().manual_seed(6)
    outs, rank, n_in = [12, 5, 7], 5, 33
    a = torch.randn(3, n_in, 3 * rank, generator=gen).to(torch.bfloat16)
    b = torch.randn(3, 3 * rank, sum(outs), generator=gen).to(torch.bfloat16)
    x, base = torch.randn(4, n_in, generator=gen).to(torch.bfloat16), torch.randn(4, sum(outs), generator=gen)
    slots, cols = torch.tensor([2, -1, 0, 1]), torch.tensor([0, 12, 17, 24], dtype=torch.int32)
    assert avx2.stream_layout(torch.bfloat16, n_in, 3 * rank, [0, 12, 17, 24]) is None
    want = native.delta_(base.to(torch.bfloat16), x, a, b, slots, cols)
    got = avx2.delta_(base.to(torch.bfloat16), x, a, b, slots, cols)
    torch.testing.assert_close(got.float(), want.float(), atol=8e-2, rtol=2e-2)
    assert torch.equal(got[1], base[1].to(torch.bfloat16))
    ops = avx2.operands(a, b, cols)  # what a decode step's calls pass (lora_decode)
    assert ops is not None and ops.stream is None
    assert torch.equal(avx2.run_(base.to(torch.bfloat16), x, slots, ops, grouped=False), got)


def _fused_slots(n_in: int, outs: list[int], rank: int, n_slots: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """bf16 A [slots, n_in, k*rank] and B [slots, k*rank, sum(outs)] of a fused projection of
    k = len(outs) parts (B block-diagonal: part j's rank block feeds part j's columns), and
    the parts' column bounds."""
    k = len(outs)
    bounds = [sum(outs[:j]) for j in range(k + 1)]
    a = (torch.randn(n_slots, n_in, k * rank, generator=gen) * 0.3).to(torch.bfloat16)
    b = torch.zeros(n_slots, k * rank, sum(outs))
    for j in range(k):
        b[:, j * rank : (j + 1) * rank, bounds[j] : bounds[j + 1]] = torch.randn(n_slots, rank, outs[j], generator=gen)
    return a, (b * 0.3).to(torch.bfloat16), bounds


@pytest.mark.parametrize("n_in, outs, rank", [(40, [70], 5), (41, [12, 5, 7], 4), (96, [48, 16, 16], 16)])
def test_grouped_c_kernel_equals_the_grouped_matmul(n_in: int, outs: list[int], rank: int) -> None:
    """The many-token bf16 kernel (prefill): any mix of rows, an odd rank or input size,
    a fused projection's diagonal blocks, equal to torch's grouped matmul in bf16."""
    kernel = load_lora_kernel()
    if kernel is None or not kernel.grouped:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    gen = torch.Generator().manual_seed(5)
    a, b, bounds = _fused_slots(n_in, outs, rank, 4, gen)
    row_slots, row_lens = [2, -1, 0, 2, 3, 1], [3, 2, 1, 20, 9, 11]  # slot 2's rows are apart; tiles of 8 and tails
    x = torch.randn(sum(row_lens), n_in, generator=gen).to(torch.bfloat16)
    base = torch.randn(sum(row_lens), sum(outs), generator=gen).to(torch.bfloat16)
    batch = LoraBatch.build(row_slots, row_lens, "cpu")
    assert batch is not None and batch.one_hot is None
    want = batch.delta_into(base.clone(), x, a, b)
    cols = torch.tensor(bounds, dtype=torch.int32)
    got = kernel.grouped_delta_(base.clone(), x, a, b, batch.token_slots, cols)
    torch.testing.assert_close(got.float(), want.float(), atol=4e-2, rtol=2e-2)  # bf16 rounding of y and out
    assert torch.equal(got[3:5], base[3:5])  # the base rows are left as they were
    b[:, 0:rank, bounds[1]:] = 1e6  # off-diagonal: never read
    torch.testing.assert_close(kernel.grouped_delta_(base.clone(), x, a, b, batch.token_slots, cols), got)


@pytest.mark.parametrize("n_in, outs, rank", [(40, [70], 5), (41, [12, 5, 7], 4), (96, [48, 16, 16], 16),
                                              (33, [37, 3], 40), (1536, [576], 16)])
def test_c_kernels_on_the_stream_copy_equal_the_grouped_matmul(n_in: int, outs: list[int], rank: int) -> None:
    """The few-token bf16 kernel on the StreamLayout copy (AVX512-BF16): an odd input size,
    odd and wide ranks (several 48-wide shrink blocks), columns off the 16-wide step, a
    fused projection's diagonal blocks, base rows among adapter rows; equal to torch's
    grouped matmul within bf16 rounding and to the row-major kernel's sums. The grouped
    kernel (prefill) on the same copy."""
    kernel = load_lora_kernel()
    if kernel is None or not kernel.grouped:
        pytest.skip("no C compiler or no AVX512-BF16 here")
    gen = torch.Generator().manual_seed(8)
    k = len(outs)
    a, b, bounds = _fused_slots(n_in, outs, rank, 4, gen)
    cols = torch.tensor(bounds, dtype=torch.int32)
    layout = kernel.stream_layout(torch.bfloat16, n_in, k * rank, bounds)
    assert layout is not None and layout.wp % 16 == 0 and layout.rp % 2 == 0
    assert kernel.stream_layout(torch.float32, n_in, k * rank, bounds) is None
    streams = torch.stack([layout.pack(a[s], b[s]) for s in range(a.shape[0])])
    unpacked = layout.unpack(streams)  # torch's paths read the slots back row-major
    assert torch.equal(unpacked[0], a) and torch.equal(unpacked[1], b)
    ops = kernel.stream_operands(layout, streams, cols)
    assert ops.stream is not None
    row_slots = [2, -1, 0, 3, 2, 1, -1]
    xd = torch.randn(len(row_slots), n_in, generator=gen).to(torch.bfloat16)
    based = torch.randn(len(row_slots), sum(outs), generator=gen).to(torch.bfloat16)
    slots_d = torch.tensor(row_slots)
    batch = LoraBatch.build(row_slots, [1] * len(row_slots), "cpu")
    assert batch is not None
    want = batch.delta_into(based.clone(), xd, a, b)  # aten's bf16 matmuls
    got_d = kernel.run_(based.clone(), xd, slots_d, ops, grouped=False)
    torch.testing.assert_close(got_d.float(), want.float(), atol=4e-2, rtol=2e-2)
    row_major = kernel.delta_(based.clone(), xd, a, b, slots_d, cols)
    torch.testing.assert_close(got_d.float(), row_major.float(), atol=2e-2, rtol=1e-2)
    assert torch.equal(got_d[1], based[1]) and torch.equal(got_d[6], based[6])  # base rows left as they were
    # the grouped many-token kernel (prefill) reads the same copy instead of repacking
    # each slot per call: the same sums as its repacked path, and equal to torch's
    row_slots, row_lens = [2, -1, 0, 2, 3, 1], [3, 2, 1, 20, 9, 11]
    token_slots = torch.tensor([s for s, n in zip(row_slots, row_lens) for _ in range(n)])
    x = torch.randn(sum(row_lens), n_in, generator=gen).to(torch.bfloat16)
    base = torch.randn(sum(row_lens), sum(outs), generator=gen).to(torch.bfloat16)
    got = kernel.run_(base.clone(), x, token_slots, ops, grouped=True)
    assert torch.equal(got, kernel.grouped_delta_(base.clone(), x, a, b, token_slots, cols))
    batch = LoraBatch.build(row_slots, row_lens, "cpu")
    assert batch is not None
    torch.testing.assert_close(got.float(), batch.delta_into(base.clone(), x, a, b).float(), atol=4e-2, rtol=2e-2)
    assert torch.equal(got[3:5], base[3:5])
    b[:, 0:rank, bounds[1]:] = 1e6  # off-diagonal blocks are not in the copy
    ops = kernel.stream_operands(layout, torch.stack([layout.pack(a[s], b[s]) for s in range(a.shape[0])]), cols)
    assert torch.equal(kernel.run_(based.clone(), xd, slots_d, ops, grouped=False), got_d)
    assert torch.equal(kernel.run_(base.clone(), x, token_slots, ops, grouped=True), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_in_the_kernels_layout_hold_each_loaded_adapter(tmp_path: Path, dtype: torch.dtype) -> None:
    """bf16 on an AVX512-BF16 CPU: LoraSlots keeps the slots only in the C kernels'
    StreamLayout (load writes a slot's streams, clear zeros them, the bytes counted are
    theirs, fewer than row-major slots'); read back row-major they hold the adapter's A and
    scaled B. A decode step through them equals PEFT's merged model. float32 keeps
    row-major slots."""
    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("no C compiler or no AVX2+FMA here")
    hf = hf_base("llama")
    config = config_for(hf.config.to_dict())
    slots = LoraSlots(config, num_slots=2, max_rank=8, dtype=dtype, device="cpu")
    streamed = kernel.grouped and dtype == torch.bfloat16
    assert bool(slots.streams) == streamed and bool(slots.a) != streamed
    held = [t for d in (*slots.a, *slots.b) for t in d.values()] + [t for _, t in slots.streams.values()]
    assert slots.nbytes == LoraSlots.bytes_for(config, 2, 8, dtype) == sum(t.nbytes for t in held)
    if streamed:
        row_major = sum(len(outs) * 8 * (fan_in + sum(outs)) for fan_in, outs in _pieces(config).values())
        assert slots.nbytes < row_major * config.num_hidden_layers * 2 * dtype.itemsize
    merged = save_adapter("llama", tmp_path / "a", seed=31, r=5)
    adapter = read_adapter("a", tmp_path / "a", config, max_rank=8)
    slots.load(1, adapter)
    for (layer, target), (a, b) in adapter.weights.items():
        proj = next(p for p, ts in FUSED.items() if target in ts)
        j = FUSED[proj].index(target)
        off = sum(_pieces(config)[proj][1][:j])
        sa, sb = slots.row_major(layer, proj)
        assert torch.equal(sa[1, :, j * 8 : j * 8 + 5], a.t().to(dtype)) and not sa[0].any()
        assert torch.equal(sb[1, j * 8 : j * 8 + 5, off : off + b.shape[0]], b.t().to(dtype)) and not sb[0].any()
    runner = ModelRunner.create(config, {k: v.detach().clone() for k, v in hf.state_dict().items()},
                                ExecutorConfig(device="cpu", dtype=str(dtype).removeprefix("torch.")), 4)
    runner.allocate_kv_cache(64)
    kv = KVCacheManager(64, 4)
    prompts = [[5, 17, 9, 4], [7, 3, 250]]
    rows = []
    for i, p in enumerate(prompts):
        assert kv.allocate(f"r{i}", len(p))
        rows.append(BatchRow(f"r{i}", p, 0, kv.block_table(f"r{i}"), None))
    got = logits_of(runner, rows, [1, -1], slots, all_slots=True)  # 7 tokens: the few-token kernel
    with torch.no_grad():
        want = merged(torch.tensor([prompts[0]])).logits[0]
        plain = hf_base("llama")(torch.tensor([prompts[0]])).logits[0]
    tol = 1e-4 if dtype == torch.float32 else 0.15
    diff, effect = (got[0].float() - want).abs().max().item(), (want - plain).abs().max().item()
    assert diff <= tol and effect > 5 * tol, (diff, effect)
    slots.clear(1)
    assert not any(t.any() for _, t in slots.streams.values()) and not any(t.any() for d in slots.a for t in d.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_triton_delta_on_cuda_equals_the_cpu() -> None:
    from prelude.kernels.triton.lora import lora_delta_

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 64, 48, generator=gen) * 0.3
    b = torch.randn(3, 48, 960, generator=gen) * 0.3
    x, base = torch.randn(6, 64, generator=gen), torch.randn(6, 960, generator=gen)
    batch = LoraBatch.build([2, -1, 0, 1], [2, 1, 2, 1], "cpu")
    assert batch is not None
    want = batch.delta_into(base.clone(), x, a, b)
    got = lora_delta_(base.cuda(), x.cuda(), a.cuda(), b.cuda(), batch.token_slots.cuda())
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
