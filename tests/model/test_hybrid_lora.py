"""LoRA adapters on hybrid models (Qwen3.5, Qwen3-Next) against PEFT's merged model
(float32, random weights): the gated attention's, the linear layers' (Qwen3-Next's grouped
in_proj_qkvz / in_proj_ba reordered as the weights are), the MLP's and the shared
expert's projections; adapters on the experts are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from prelude.config import ExecutorConfig
from prelude.executor.runner import ModelRunner
from prelude.forward_batch import BatchRow
from prelude.kv.kv_manager import KVCacheManager
from prelude.model.lora.adapters import LoraBatch, LoraError, LoraSlots, LoraStep, read_adapter
from prelude.model.registry import config_for

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

QWEN3_5_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
# (PEFT turns a bare gate_proj/up_proj/down_proj on a mixture of experts into adapters on the
# experts' parameters: named by path, the dense MLP's and the shared expert's only)
QWEN3_NEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                      "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                      "in_proj_qkvz", "in_proj_ba", "out_proj", "shared_expert_gate"]
HYBRID: dict[str, Any] = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=24, linear_value_head_dim=20,
                              max_position_embeddings=512, tie_word_embeddings=False)


def hf_base(kind: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HYBRID))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
            shared_expert_intermediate_size=48, mlp_only_layers=[1]))
    with torch.no_grad():  # HF initialises the (1 + w) norms at zero: move them off it
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.normal_(0, 0.3)
            if name.endswith("mlp.gate.weight"):  # a sharper router than the init's zeros
                p.normal_(0, 0.3)
    return model.float().eval()


def save_adapter(kind: str, path: Path, seed: int, targets: list[str], r: int = 8) -> Any:
    """A random PEFT adapter on hf_base(kind) saved at `path`; returns PEFT's merged model."""
    from peft.utils import transformers_weight_conversion as conversion

    # PEFT maps every target named *gate_proj/up_proj/down_proj on a mixture-of-experts model to
    # the experts' stacked parameters (what Prelude refuses); off here, they name the
    # shared expert's and the dense MLP's modules, as an adapter trained on them does
    convert = conversion._convert_peft_config_moe
    conversion._convert_peft_config_moe = lambda *args: None
    try:
        model = peft.get_peft_model(hf_base(kind), peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                                     init_lora_weights=False))
    finally:
        conversion._convert_peft_config_moe = convert
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return model.merge_and_unload().eval()


def runner_for(kind: str) -> tuple[ModelRunner, KVCacheManager]:
    hf = hf_base(kind)
    config = config_for({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    runner = ModelRunner.create(config, weights, ExecutorConfig(device="cpu", dtype="float32"), 4)
    runner.allocate_kv_cache(64, state_slots=8)
    return runner, KVCacheManager(64, 4)


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def logits_of(runner: ModelRunner, kv: KVCacheManager, prompts: list[list[int]], row_slots: list[int],
              slots: LoraSlots, all_slots: bool, tag: str) -> list[torch.Tensor]:
    """One paged forward of fresh prompts, each in its own state slot. `all_slots`: the
    masked all-slots path (few tokens), else the grouped one."""
    rows = []
    for i, p in enumerate(prompts):
        assert kv.allocate(f"{tag}{i}", len(p))
        rows.append(BatchRow(f"{tag}{i}", p, 0, kv.block_table(f"{tag}{i}"), None, state_slot=i))
    inputs = runner.inputs.paged(tuple(rows))
    batch = LoraBatch.build(row_slots, [len(p) for p in prompts], "cpu", slots.num_slots if all_slots else 0)
    assert batch is not None and (batch.one_hot is not None) == all_slots
    hidden = runner.model.forward(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches,
                                  lora=LoraStep(slots, batch))
    logits = runner.model.compute_logits(hidden)
    return [logits[s:s + len(p)] for s, p in zip(inputs.starts, prompts)]


@pytest.mark.parametrize("kind,targets", [("qwen3_5", QWEN3_5_TARGETS), ("qwen3_next", QWEN3_NEXT_TARGETS)])
def test_two_adapters_in_one_batch_equal_peft_merged(tmp_path: Path, kind: str, targets: list[str]) -> None:
    merged = [save_adapter(kind, tmp_path / "a", seed=3, targets=targets),
              save_adapter(kind, tmp_path / "b", seed=4, targets=targets[1::2], r=4)]
    runner, kv = runner_for(kind)
    layout = runner.model.lora_layout()
    slots = LoraSlots(layout, num_slots=3, max_rank=8, dtype=torch.float32, device="cpu")
    adapters = [read_adapter(n, tmp_path / n, layout, max_rank=8) for n in ("a", "b")]
    assert {t for _, t in adapters[0].weights} == {t.rsplit(".", 1)[-1] for t in targets}
    slots.load(1, adapters[0])
    slots.load(2, adapters[1])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (11, 6, 9)]
    base = hf_base(kind)
    wants = [hf_logits(merged[0], prompts[0]), hf_logits(base, prompts[1]), hf_logits(merged[1], prompts[2])]
    for all_slots in (False, True):
        got = logits_of(runner, kv, [p[:3] for p in prompts] if all_slots else prompts, [1, -1, 2], slots, all_slots,
                        f"{kind}{all_slots}")
        for g, w, p in zip(got, wants, prompts):
            w = w[:len(g)]
            assert torch.equal(g.argmax(-1), w.argmax(-1))
            assert (g.log_softmax(-1) - w.log_softmax(-1)).abs().max().item() <= 1e-3, all_slots
            assert (g - w).abs().max().item() <= 1e-4
    for m, p in ((merged[0], prompts[0]), (merged[1], prompts[2])):  # the adapters do change the logits
        assert (hf_logits(m, p) - hf_logits(base, p)).abs().max().item() > 1e-2


def test_the_linear_layers_alone_change_what_they_should(tmp_path: Path) -> None:
    """An adapter on the DeltaNet projections only (each of them) equals PEFT's."""
    merged = save_adapter("qwen3_5", tmp_path / "a", seed=6, targets=["in_proj_b", "in_proj_a", "out_proj"])
    runner, kv = runner_for("qwen3_5")
    slots = LoraSlots(runner.model.lora_layout(), num_slots=1, max_rank=8, dtype=torch.float32, device="cpu")
    slots.load(0, read_adapter("a", tmp_path / "a", runner.model.lora_layout(), max_rank=8))
    prompt = list(range(20, 33))
    (got,) = logits_of(runner, kv, [prompt], [0], slots, False, "x")
    assert (got - hf_logits(merged, prompt)).abs().max().item() <= 1e-4


def _write_adapter(path: Path, tensors: dict[str, torch.Tensor], **cfg: Any) -> None:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, **cfg}))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_adapters_on_experts_or_missing_modules_are_refused(tmp_path: Path) -> None:
    runner, _ = runner_for("qwen3_next")
    layout = runner.model.lora_layout()
    a, b = torch.zeros(2, 64), torch.zeros(40, 2)
    _write_adapter(tmp_path / "experts", {"base_model.model.model.layers.0.mlp.experts.1.gate_proj.lora_A.weight": a,
                                          "base_model.model.model.layers.0.mlp.experts.1.gate_proj.lora_B.weight": b})
    with pytest.raises(LoraError, match="mixture-of-experts"):
        read_adapter("e", tmp_path / "experts", layout, max_rank=8)
    _write_adapter(tmp_path / "params", {}, target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(LoraError, match="mixture-of-experts"):
        read_adapter("p", tmp_path / "params", layout, max_rank=8)
    # a module of an attention layer on a linear one (layer 0 is linear attention)
    _write_adapter(tmp_path / "wrong", {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
                                        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b})
    with pytest.raises(LoraError, match="layer 0 has no module 'self_attn.q_proj'"):
        read_adapter("w", tmp_path / "wrong", layout, max_rank=8)
    _write_adapter(tmp_path / "router", {"base_model.model.model.layers.0.mlp.gate.lora_A.weight": a,
                                         "base_model.model.model.layers.0.mlp.gate.lora_B.weight": torch.zeros(4, 2)})
    with pytest.raises(LoraError, match="mixture-of-experts"):
        read_adapter("r", tmp_path / "router", layout, max_rank=8)


def test_slot_bytes_follow_the_layers_kinds() -> None:
    runner, _ = runner_for("qwen3_5")
    layout = runner.model.lora_layout()
    assert [tuple(p.name for p in layer) for layer in layout.layers] == [
        ("in_proj", "out_proj", "gate_up", "down")] * 3 + [("qkv", "o_proj", "gate_up", "down")]
    slots = LoraSlots(layout, num_slots=2, max_rank=4, dtype=torch.float32, device="cpu")
    assert slots.nbytes == LoraSlots.bytes_for(layout, 2, 4, torch.float32) > 0


def test_bf16_slots_stay_close_to_peft_merged(tmp_path: Path) -> None:
    """bf16 (on an AVX512-BF16 CPU the C kernels' own slot layout) for every layer kind."""
    merged = save_adapter("qwen3_5", tmp_path / "a", seed=8, targets=QWEN3_5_TARGETS)
    hf = hf_base("qwen3_5")
    config = config_for({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
    runner = ModelRunner.create(config, {k: v.detach().clone() for k, v in hf.state_dict().items()},
                                ExecutorConfig(device="cpu", dtype="bfloat16"), 4)
    runner.allocate_kv_cache(64, state_slots=8)
    kv = KVCacheManager(64, 4)
    layout = runner.model.lora_layout()
    slots = LoraSlots(layout, num_slots=2, max_rank=8, dtype=torch.bfloat16, device="cpu")
    slots.load(1, read_adapter("a", tmp_path / "a", layout, max_rank=8))
    prompt = list(range(30, 70))
    want = hf_logits(merged, prompt).softmax(-1)
    base = hf_logits(hf, prompt).softmax(-1)
    for all_slots in (False, True):
        p = prompt[:4] if all_slots else prompt
        (got,) = logits_of(runner, kv, [p], [1], slots, all_slots, f"bf{all_slots}")
        diff = (got.float().softmax(-1) - want[:len(p)]).abs().max().item()
        assert diff < 0.05 and diff < (base[:len(p)] - want[:len(p)]).abs().max().item(), all_slots
