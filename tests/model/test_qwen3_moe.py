"""Qwen3-MoE and the mixture-of-experts layer against transformers (random weights, small
configs): the logits and greedy tokens, router ties, mlp_only_layers / decoder_sparse_step,
the per-row (batch-invariant) path, experts read only when chosen, LoRA on the attention only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from prelude import LLM, SamplingParams
from prelude.config import ExecutorConfig
from prelude.executor.runner import ModelRunner
from prelude.forward_batch import BatchRow
from prelude.kv.kv_manager import KVCacheManager
from prelude.model.arch.qwen3_moe import expert_layers
from prelude.kernels.cpu.moe_experts import load_moe_experts
from prelude.model.layers.moe import SharedExpert, SparseMoe, describe
from prelude.model.lora.adapters import LoraError, read_adapter
from prelude.model.registry import config_for

from tests.engine.tiny import tiny_engine
from tests.model.test_decoder_numerics import _run as _logits  # the serving trunk's logits per row

transformers = pytest.importorskip("transformers")

TINY: dict[str, Any] = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=256, num_experts=8, num_experts_per_tok=2,
                            tie_word_embeddings=False)


def hf_moe(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**{**TINY, "mlp_only_layers": [1], **overrides})
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # a sharper router than the init's
                p.copy_(torch.randn_like(p) * 0.3)
    return model.to(dtype).eval()


def _weights(hf: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def _runner(hf: Any, dtype: str = "float32", weights: dict[str, torch.Tensor] | None = None,
            batch_invariant: bool = False) -> tuple[ModelRunner, KVCacheManager]:
    runner = ModelRunner.create(config_for(hf.config.to_dict()), weights or _weights(hf),
                                ExecutorConfig(device="cpu", dtype=dtype, batch_invariant=batch_invariant), 4)
    runner.allocate_kv_cache(64)
    return runner, KVCacheManager(64, 4)


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]


def _prefill_then_decode(hf: Any, runner: ModelRunner, kv: KVCacheManager, tol: float, steps: int = 5) -> None:
    """Prompts batched, then greedy decode batched: each row's logits within `tol` of
    transformers' on the same tokens, and the greedy tokens transformers'."""
    prompts = _prompts(1, (7, 1, 13, 4))
    rows = []
    for i, p in enumerate(prompts):
        assert kv.allocate(str(i), len(p))
        rows.append(BatchRow(str(i), p, 0, kv.block_table(str(i)), None))
    seqs = [list(p) for p in prompts]
    for p, got in zip(prompts, _logits(runner, rows)):
        assert (got - _hf_logits(hf, p)).abs().max().item() <= tol
    for _ in range(steps):
        rows = []
        for i, s in enumerate(seqs):
            want = _hf_logits(hf, s)[-1]
            s.append(int(want.argmax()))
            assert kv.allocate(str(i), len(s))
            rows.append(BatchRow(str(i), [s[-1]], len(s) - 1, kv.block_table(str(i)), None))
        for s, got in zip(seqs, _logits(runner, rows)):
            want = _hf_logits(hf, s)[-1]
            assert (got[-1] - want).abs().max().item() <= tol
            assert int(got[-1].argmax()) == int(want.argmax())


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 2}])
def test_float32_logits_and_greedy_tokens_equal_transformers(overrides: dict[str, Any]) -> None:
    hf = hf_moe(**overrides)
    runner, kv = _runner(hf)
    assert any(layer.moe is not None for layer in runner.model.layers)
    _prefill_then_decode(hf, runner, kv, tol=1e-4)


def test_bf16_logits_within_tolerance_of_transformers() -> None:
    hf = hf_moe(dtype=torch.bfloat16, norm_topk_prob=True)
    runner, kv = _runner(hf, dtype="bfloat16")
    prompts = _prompts(4, (9, 16))
    for n, p in enumerate(prompts):
        assert kv.allocate(str(n), len(p))
        (got,) = _logits(runner, [BatchRow(str(n), p, 0, kv.block_table(str(n)), None)])
        want = _hf_logits(hf, p)
        assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_router_ties_pick_the_experts_transformers_picks() -> None:
    hf = hf_moe(seed=2, norm_topk_prob=True)
    with torch.no_grad():  # experts 1, 3, 4 and 6 score alike on every token, the others zero: ties either way
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                for e in (3, 4, 6):
                    p[e].copy_(p[1])
                for e in (0, 2, 5, 7):
                    p[e].zero_()
    runner, kv = _runner(hf)
    block = runner.model.layers[0].moe
    x = torch.randn(6, 64)
    probs = torch.softmax(F.linear(x, block.router), dim=-1)
    assert (probs[:, 1] == probs[:, 3]).all() and (probs[:, 1] == probs[:, 6]).all()
    _prefill_then_decode(hf, runner, kv, tol=1e-4, steps=3)


def test_saved_checkpoint_with_one_tensor_an_expert_loads_the_same_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    hf = hf_moe()
    hf.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved  # one tensor an expert
    raw = json.loads((tmp_path / "config.json").read_text())
    runner_saved, kv = _runner(hf, weights=saved)
    assert runner_saved.model.config == config_for(raw)
    runner_mem, kv2 = _runner(hf)
    p = _prompts(3, (10,))[0]
    assert kv.allocate("a", len(p)) and kv2.allocate("a", len(p))
    (a,) = _logits(runner_saved, [BatchRow("a", p, 0, kv.block_table("a"), None)])
    (b,) = _logits(runner_mem, [BatchRow("a", p, 0, kv2.block_table("a"), None)])
    assert torch.equal(a, b)


def test_expert_layers_follow_decoder_sparse_step_and_mlp_only_layers() -> None:
    raw = {"num_hidden_layers": 6, "num_experts": 4}
    assert expert_layers({**raw, "decoder_sparse_step": 1}) == (0, 1, 2, 3, 4, 5)
    assert expert_layers({**raw, "decoder_sparse_step": 2}) == (1, 3, 5)
    assert expert_layers({**raw, "decoder_sparse_step": 1, "mlp_only_layers": [0, 4]}) == (1, 2, 3, 5)
    assert expert_layers({**raw, "num_experts": 0}) == ()


class Experts:
    """A block's weights as made (the CPU kernel's block holds a packed copy instead)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down


def _block(seed: int, experts: int = 8, top_k: int = 2, hidden: int = 48, inter: int = 24,
           shared: bool = False, dtype: torch.dtype = torch.float32,
           own_kernels: bool = True) -> tuple[SparseMoe, Experts]:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=gen) * 0.3).to(dtype)  # noqa: E731
    shared_expert = SharedExpert(r(2 * inter, hidden), r(hidden, inter), r(1, hidden), F.silu) if shared else None
    router, gate_up, down = r(experts, hidden), r(experts, 2 * inter, hidden), r(experts, hidden, inter)
    block = SparseMoe(router, gate_up, down, top_k, True, F.silu, shared_expert, own_kernels=own_kernels)
    return block, Experts(gate_up, down)


def _dense_reference(block: SparseMoe, weights_of: Experts, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, masked to the chosen ones (float64)."""
    weights, experts = block.route(x)
    xd, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for e in range(block.num_experts):
        gate, up = F.linear(xd, weights_of.gate_up[e].double()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, weights_of.down[e].double())
        w = (weights.double() * (experts == e)).sum(-1, keepdim=True)
        out += w * y
    if block.shared is not None:
        s = block.shared
        g, u = F.linear(xd, s.gate_up.double()).chunk(2, dim=-1)
        out += torch.sigmoid(F.linear(xd, s.gate.double())) * F.linear(F.silu(g) * u, s.down.double())
    return out


@pytest.mark.parametrize("own_kernels", [True, False])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (37, 8, 2), (53, 16, 4), (5, 3, 3)])
def test_grouped_and_per_row_paths_equal_every_expert_masked(shared: bool, tokens: int, experts: int,
                                                             top_k: int, own_kernels: bool) -> None:
    block, made = _block(tokens, experts, top_k, hidden=40, inter=20, shared=shared,  # off-size widths
                         own_kernels=own_kernels)
    assert (block.path == "torch") == (not own_kernels or load_moe_experts() is None)
    x = torch.randn(tokens, 40, generator=torch.Generator().manual_seed(9))
    want = _dense_reference(block, made, x)
    assert (block(x).double() - want).abs().max().item() <= 1e-5
    block.make_batch_invariant()
    assert (block(x).double() - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("own_kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_path_gives_a_row_the_same_bits_whatever_shares_its_step(dtype: torch.dtype,
                                                                          own_kernels: bool) -> None:
    block, _ = _block(5, dtype=dtype, own_kernels=own_kernels)
    block.make_batch_invariant()
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    together = block(x)
    for t in (0, 7, 39):
        assert torch.equal(block(x[t:t + 1]), together[t:t + 1])  # alone
    for a, b in ((0, 5), (4, 9), (30, 40)):
        assert torch.equal(block(x[a:b]), together[a:b])  # among a few others


def _poison(block: SparseMoe, made: Experts, e: int) -> None:
    """Expert e's weights all NaN, wherever the block reads them from."""
    made.gate_up[e].fill_(float("nan"))
    made.down[e].fill_(float("nan"))
    if block.packed is not None:  # every bit set: NaN in float32 and in bf16
        for copy in (block.packed.gate_up, block.packed.down):
            copy.view(block.num_experts, -1)[e].view(torch.uint8).fill_(0xFF)


@pytest.mark.parametrize("own_kernels", [True, False])
def test_a_step_reads_only_the_experts_its_tokens_chose(own_kernels: bool) -> None:
    block, made = _block(6, experts=16, top_k=2, own_kernels=own_kernels)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2))
    want = block(x)
    chosen = set(block.route(x)[1].flatten().tolist())
    assert len(chosen) < 16
    for e in set(range(16)) - chosen:  # unchosen experts poisoned: never read, nothing changes
        _poison(block, made, e)
    assert torch.equal(block(x), want)
    block.make_batch_invariant()
    assert torch.isfinite(block(x)).all()
    _poison(block, made, next(iter(chosen)))  # the poison reaches the output once a chosen expert has it
    assert not torch.isfinite(block(x)).all()


def test_the_start_up_line_names_the_way_the_experts_run() -> None:
    block, _ = _block(1)
    plain, _ = _block(1, own_kernels=False)
    assert plain.path == "torch" and plain.gate_up is not None
    assert "torch F.linear" in describe({0: plain}, torch.float32)
    if load_moe_experts() is not None:  # the packed copy replaces the checkpoint's tensors
        assert block.path == "cpu_kernel" and block.gate_up is None and block.packed is not None
        assert "moe_experts.c" in describe({0: block}, torch.float32)
    block.make_batch_invariant()
    assert "batch-invariant" in describe({0: block}, torch.float32)


def test_batch_invariant_engine_answers_a_row_alike_alone_and_batched() -> None:
    hf = hf_moe(seed=4)
    runner, kv = _runner(hf, batch_invariant=True)
    assert all(layer.moe.per_row for layer in runner.model.layers if layer.moe is not None)
    prompts = _prompts(6, (9, 5, 12))
    alone = []
    for i, p in enumerate(prompts):
        assert kv.allocate(f"a{i}", len(p))
        alone.append(_logits(runner, [BatchRow(f"a{i}", p, 0, kv.block_table(f"a{i}"), None)])[0])
    rows = []
    for i, p in enumerate(prompts):
        assert kv.allocate(f"b{i}", len(p))
        rows.append(BatchRow(f"b{i}", p, 0, kv.block_table(f"b{i}"), None))
    for a, b in zip(alone, _logits(runner, rows)):
        assert (a - b).abs().max().item() <= 1e-5  # the dense projections' routes may still differ in the last bits


def test_engine_greedy_tokens_equal_transformers_generate() -> None:
    hf = hf_moe(seed=5, vocab_size=260)  # the byte tokenizer's table: every head row can be sampled
    llm = LLM(engine=tiny_engine(hf, max_num_batched_tokens=8))  # chunked prompts beside decodes
    prompts = [[t % 256 for t in p] for p in _prompts(7, (11, 3, 20))]
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert result.outputs[0].token_ids == want[0, len(prompt):].tolist()


def _save_adapter(path: Path, targets: list[str]) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(hf_moe(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                          init_lora_weights=False))
    model.save_pretrained(str(path))


def test_lora_on_attention_loads_and_on_experts_is_refused(tmp_path: Path) -> None:
    config = config_for(hf_moe().config.to_dict())
    _save_adapter(tmp_path / "attn", ["q_proj", "o_proj"])
    assert read_adapter("attn", tmp_path / "attn", config, max_rank=8).rank == 4
    _save_adapter(tmp_path / "mlp", ["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(LoraError, match="mixture-of-experts"):
        read_adapter("mlp", tmp_path / "mlp", config, max_rank=8)


def test_a_lora_adapter_on_the_attention_equals_peft_merged(tmp_path: Path) -> None:
    from prelude.model.lora.adapters import LoraBatch, LoraSlots, LoraStep

    peft = pytest.importorskip("peft")
    torch.manual_seed(12)
    model = peft.get_peft_model(hf_moe(seed=12), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.save_pretrained(str(tmp_path / "a"))
    merged = model.merge_and_unload().eval()
    runner, kv = _runner(hf_moe(seed=12))
    config = runner.model.config
    slots = LoraSlots(config, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    slots.load(1, read_adapter("a", tmp_path / "a", config, max_rank=8))
    p = _prompts(12, (14,))[0]
    assert kv.allocate("a", len(p))
    inputs = runner.inputs.paged((BatchRow("a", p, 0, kv.block_table("a"), None),))
    step = LoraStep(slots, LoraBatch.build([1], [len(p)], "cpu", 0))
    hidden = runner.model.forward(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches, lora=step)
    got = runner.model.compute_logits(hidden)
    assert (got - _hf_logits(merged, p)).abs().max().item() <= 1e-4
    assert (got - _hf_logits(hf_moe(seed=12), p)).abs().max().item() > 1e-2
