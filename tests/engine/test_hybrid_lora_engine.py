"""LoRA adapters on a hybrid model through the engine: two adapters and the base in one
batch, chunked prompts and decode steps, each request's greedy tokens equal to its
merged model's; an adapter on a Qwen3-Next's experts is refused when it loads (the
server's 400)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from prelude.config import LoraConfig
from prelude.engine.request import LoraRequest, SamplingParams
from prelude.model.lora.adapters import LoraError
from tests.engine.tiny import VOCAB, tiny_engine

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
SHAPE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=24, linear_value_head_dim=20,
                             max_position_embeddings=1024, eos_token_id=256, tie_word_embeddings=False)


def hf_qwen3_5() -> Any:
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.normal_(0, 0.3)
    return model


def save_adapter(path: Path, seed: int, targets: list[str], r: int) -> Any:
    model = peft.get_peft_model(hf_qwen3_5(), peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                                init_lora_weights=False))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(path))
    return model.merge_and_unload().eval()


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("engine_kw", [dict(), dict(max_num_batched_tokens=8)], ids=["whole", "chunked"])
def test_two_adapters_and_the_base_in_one_batch(tmp_path: Path, engine_kw: dict[str, Any]) -> None:
    merged = [save_adapter(tmp_path / "a", 1, TARGETS, 8), save_adapter(tmp_path / "b", 2, TARGETS[5:], 4)]
    loras = [LoraRequest("a", str(tmp_path / "a"), 1), LoraRequest("b", str(tmp_path / "b"), 2)]
    engine = tiny_engine(hf_qwen3_5(), lora=LoraConfig(max_loras=2, max_lora_rank=8), **engine_kw)
    work = [(list(range(5, 19)), 0), (list(range(40, 47)), None), (list(range(9, 20)), 1), (list(range(60, 63)), 0)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    for i, (prompt, which) in enumerate(work):
        engine.add_request(str(i), prompt, params, lora=None if which is None else loras[which])
        outs[str(i)] = []
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
    engine.check_integrity()
    assert engine.kv.num_free_slots == engine.num_state_slots
    base = hf_qwen3_5()
    for i, (prompt, which) in enumerate(work):
        model = base if which is None else merged[which]
        assert outs[str(i)] == hf_greedy(model, prompt, 6), i
    assert any(hf_greedy(m, work[0][0], 6) != hf_greedy(base, work[0][0], 6) for m in merged)


def test_an_adapter_on_experts_is_refused_when_it_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)).float().eval()
    # PEFT puts gate/up/down on a mixture of experts onto the experts' stacked parameters
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                                            init_lora_weights=False)).save_pretrained(str(tmp_path / "e"))
    engine = tiny_engine(transformers.Qwen3NextForCausalLM(hf.config).float().eval(),
                         lora=LoraConfig(max_loras=1, max_lora_rank=8))
    with pytest.raises(LoraError, match="mixture-of-experts"):
        engine.check_adapter(LoraRequest("e", str(tmp_path / "e"), 1))
    peft.get_peft_model(transformers.Qwen3NextForCausalLM(hf.config).float().eval(), peft.LoraConfig(
        r=4, target_modules=["q_proj", "in_proj_qkvz", "out_proj"], init_lora_weights=False,
    )).save_pretrained(str(tmp_path / "ok"))
    assert engine.check_adapter(LoraRequest("ok", str(tmp_path / "ok"), 2)) == ()


def test_oneshot_rows_take_their_adapter(tmp_path: Path) -> None:
    """Prompt logprobs of a one-token request (a OneShot row: its state on scratch) under an
    adapter equal the merged model's, beside a base row in the same step."""
    merged = save_adapter(tmp_path / "a", 3, TARGETS, 8)
    engine = tiny_engine(hf_qwen3_5(), lora=LoraConfig(max_loras=1, max_lora_rank=8))
    prompt = list(range(7, 30))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    got: dict[str, list[float]] = {}
    for rid, lora in (("a", LoraRequest("a", str(tmp_path / "a"), 1)), ("base", None)):
        engine.add_request(rid, prompt, params, lora=lora)
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = [lp.logprob for lp in out.prompt_logprobs[1:]]
    engine.check_integrity()
    assert engine.kv.num_free_slots == engine.num_state_slots  # OneShot rows hold no slot
    for rid, model in (("a", merged), ("base", hf_qwen3_5())):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
        want = [ref[i - 1, t].item() for i, t in enumerate(prompt) if i > 0]
        assert got[rid] == pytest.approx(want, abs=1e-3), rid
    assert got["a"] != pytest.approx(got["base"], abs=1e-2)


def _greedy_logprobs(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    tokens = hf_greedy(model, prompt, n)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return tokens, logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_cached_prefixes_and_their_states_stay_with_their_adapter(tmp_path: Path) -> None:
    """A prompt served under an adapter, then under the base, then under the adapter again:
    the prefix cache (KV and recurrent-state checkpoints) never crosses adapters, and the
    hit under the same adapter gives the cold tokens and logprobs."""
    merged = save_adapter(tmp_path / "a", 5, TARGETS, 8)
    lora = LoraRequest("a", str(tmp_path / "a"), 1)
    engine = tiny_engine(hf_qwen3_5(), lora=LoraConfig(max_loras=1, max_lora_rank=8), num_blocks=400,
                         max_num_batched_tokens=256)
    prompt = [3 + (i * 7) % 250 for i in range(530)]  # past the default checkpoint stride (512 tokens)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    want = {"base": _greedy_logprobs(hf_qwen3_5(), prompt, 4), "a": _greedy_logprobs(merged, prompt, 4)}
    assert want["base"][1] != pytest.approx(want["a"][1], abs=1e-2)
    reused = []
    for i, which in enumerate((lora, None, lora)):
        before = engine.metrics()["prefix_reused_tokens_total"]
        engine.add_request(str(i), prompt, params, lora=which)
        tokens: list[int] = []
        logprobs: list[float] = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens.extend(o.new_token_ids)
                logprobs.extend(lp.logprob for lp in o.logprobs)
        wanted_tokens, wanted_logprobs = want["a" if which is not None else "base"]
        assert tokens == wanted_tokens and logprobs == pytest.approx(wanted_logprobs, abs=1e-3), i
        reused.append(engine.metrics()["prefix_reused_tokens_total"] - before)
    assert reused[0] == reused[1] == 0 and reused[2] > 0  # the base found nothing of the adapter's
    engine.check_integrity()
