"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) against transformers, random
weights from small configs; the delta rule and conv kernels against transformers' torch
reference functions at off-size head dims."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from prelude.executor.inputs import InputBuilder, RowLayout  # noqa: E402
from prelude.model import registry  # noqa: E402
from prelude.model.attention.metadata import StateRow, StateRows  # noqa: E402
from prelude.model.base import UnsupportedCheckpoint  # noqa: E402
from prelude.model.layers.delta_rule import (  # noqa: E402
    causal_conv,
    causal_conv_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_step,
)


def tiny_config(**kw: Any) -> Any:
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=24, linear_value_head_dim=20, linear_conv_kernel_dim=4,
                max_position_embeddings=512)
    return transformers.Qwen3_5TextConfig(**{**base, **kw})


def hf_model(seed: int = 0, cls: Any = None, **kw: Any) -> Any:
    torch.manual_seed(seed)
    model = (cls or transformers.Qwen3_5ForCausalLM)(tiny_config(**kw)).float().eval()
    with torch.no_grad():  # HF initialises the (1 + w) norms at zero: move them off it
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.normal_(0, 0.3)
    return model


def build(hf: Any, dtype: torch.dtype = torch.float32, raw: dict[str, Any] | None = None,
          weights: dict[str, torch.Tensor] | None = None) -> Any:
    raw = raw or {**hf.config.to_dict(), "architectures": [type(hf).__name__]}
    config = registry.config_for(raw)
    return registry.build_model(config, weights or dict(hf.state_dict()), dtype, torch.device("cpu"), None)


def oneshot_hidden(model: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One forward of whole prompts on scratch state (what a OneShot step computes)."""
    builder = InputBuilder(torch.device("cpu"), 16, False)
    inputs = builder.flatten([RowLayout(p, range(len(p)), [-1] * len(p), (), len(p), False, decode=False)
                           for p in prompts], write_kv=False)
    hidden = model.forward(inputs.input_ids, inputs.positions, inputs.meta, model.allocate_kv_cache(1, 16))
    return [hidden[s:s + len(p)] for s, p in zip(inputs.starts, prompts)]


def assert_float32_matches(hf: Any, model: Any, prompts: list[list[int]]) -> None:
    """Each prompt of one OneShot forward: transformers' greedy tokens, log-probs within 1e-3."""
    for prompt, hidden in zip(prompts, oneshot_hidden(model, prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        logits = model.compute_logits(hidden)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        assert (logits.log_softmax(-1) - ref.log_softmax(-1)).abs().max() < 1e-3


def test_float32_logits_equal_transformers_for_a_batch_of_prompts() -> None:
    hf = hf_model()
    model = build(hf)
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (150, 7, 1, 64)]
    assert_float32_matches(hf, model, prompts)


def test_bf16_stays_close_to_float32_transformers() -> None:
    hf = hf_model(1)
    model = build(hf, torch.bfloat16)
    prompt = torch.randint(0, 300, (40,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = model.compute_logits(oneshot_hidden(model, [prompt])[0]).log_softmax(-1)
    assert (got.exp() - ref.exp()).abs().max() < 0.05


def test_the_text_model_of_a_conditional_generation_checkpoint_is_served(caplog: pytest.LogCaptureFixture) -> None:
    hf = hf_model(2)
    text = hf.config.to_dict()
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
           "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    weights = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in hf.state_dict().items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    weights["mtp.fc.weight"] = torch.zeros(2, 2)
    with caplog.at_level("INFO"):
        model = build(hf, raw=raw, weights=weights)
    assert "the vision tower (1 tensors) left out" in caplog.text
    prompt = [5, 6, 7, 8, 9]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (model.compute_logits(oneshot_hidden(model, [prompt])[0]) - ref).abs().max() < 1e-4


def test_a_sequence_classification_head_scores_as_transformers() -> None:
    hf = hf_model(3, cls=transformers.Qwen3_5ForSequenceClassification, num_labels=3, pad_token_id=0)
    model = build(hf)
    prompt = [4, 9, 17, 33, 2, 8]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    got = model.classify(oneshot_hidden(model, [prompt])[0])
    assert torch.allclose(got, ref, atol=1e-4)


def test_an_unknown_layer_type_is_refused_in_one_line() -> None:
    raw = {**tiny_config().to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    raw["layer_types"] = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedCheckpoint, match="layer_types"):
        registry.config_for(raw)


# --- kernels against transformers' torch reference ----------------------------------


def _inputs(length: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, hk, dk, generator=g).to(dtype)
    k = torch.randn(1, length, hk, dk, generator=g).to(dtype)
    v = torch.randn(1, length, hv, dv, generator=g).to(dtype)
    decay = -torch.rand(1, length, hv, generator=g) * 0.5
    beta = torch.rand(1, length, hv, generator=g).to(dtype)
    state = torch.randn(1, hv, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(2, 4, 24, 20), (1, 1, 40, 72), (3, 3, 128, 128)])
def test_chunked_delta_rule_matches_the_reference(dtype: torch.dtype, dims: tuple[int, int, int, int]) -> None:
    hk, hv, dk, dv = dims
    q, k, v, decay, beta, state = _inputs(150, hk, hv, dk, dv, dtype)
    ref_out, ref_state = hf_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=state,
                                                                  output_final_state=True,
                                                                  use_qk_l2norm_in_kernel=True)
    out, got_state = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    assert torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol)
    assert torch.allclose(got_state, ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_step_matches_the_reference_and_updates_in_place(dtype: torch.dtype) -> None:
    q, k, v, decay, beta, state = _inputs(1, 2, 4, 24, 20, dtype)
    ref_out, ref_state = hf_qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=state,
                                                                      output_final_state=True,
                                                                      use_qk_l2norm_in_kernel=True)
    mine = state.clone()
    out = recurrent_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], decay[:, 0], beta[:, 0], mine)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), ref_out[:, 0].float(), atol=tol, rtol=tol)
    assert torch.allclose(mine, ref_state, atol=1e-5)


def test_chunked_prefill_in_pieces_gives_the_state_of_one_piece() -> None:
    q, k, v, decay, beta, _ = _inputs(200, 2, 4, 24, 20, torch.float32, seed=1)
    whole_out, whole_state = chunk_gated_delta_rule(q, k, v, decay, beta, None)
    state = None
    outs = []
    for lo, hi in ((0, 70), (70, 71), (71, 200)):
        o, state = chunk_gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], decay[:, lo:hi], beta[:, lo:hi], state)
        outs.append(o)
    assert torch.allclose(torch.cat(outs, dim=1), whole_out, atol=1e-5)
    assert torch.allclose(state, whole_state, atol=1e-5)


def test_the_conv_carries_its_state_across_pieces_and_steps() -> None:
    torch.manual_seed(0)
    x = torch.randn(20, 12)
    weight = torch.randn(12, 4)
    ref = hf_qwen3_5.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    out1, state = causal_conv(x[:13], weight, None)
    out2, state = causal_conv(x[13:19], weight, state)
    steps = state.unsqueeze(0).clone()
    out3 = causal_conv_step(x[19:20], weight, steps)
    assert torch.allclose(torch.cat([out1, out2, out3]), ref, atol=1e-5)


def test_packed_items_each_continue_the_shared_state() -> None:
    """Multi-item scoring packs items after a shared prompt; each item must see the shared
    part's state (and K/V) and itself only: as if scored one by one."""
    hf = hf_model(4)
    model = build(hf)
    shared, items = [3, 1, 4, 1, 5, 9, 2, 6], [[7, 7, 8], [11, 12], [13]]
    ids = shared + [t for item in items for t in item]
    positions = list(range(len(shared)))
    segments = [0] * len(shared)
    for i, item in enumerate(items, start=1):
        positions += range(len(shared), len(shared) + len(item))
        segments += [i] * len(item)
    builder = InputBuilder(torch.device("cpu"), 16, False, recurrent=True)
    inputs = builder.flatten([RowLayout(ids, positions, [-1] * len(ids), (), len(ids), False, decode=False,
                                     segments=segments)], write_kv=False)
    assert inputs.meta.states is not None and inputs.meta.states.rows[0].items == (3, 2, 1)
    hidden = model.forward(inputs.input_ids, inputs.positions, inputs.meta, model.allocate_kv_cache(1, 16))
    at = len(shared)
    for item in items:
        alone = oneshot_hidden(model, [shared + item])[0][len(shared):]
        assert torch.allclose(hidden[at:at + len(item)], alone, atol=1e-5)
        at += len(item)


def test_state_rows_batch_decode_rows_and_keep_prompt_rows_apart() -> None:
    builder = InputBuilder(torch.device("cpu"), 4, False, recurrent=True)
    layouts = [RowLayout([1, 2, 3], range(3), [0, 1, 2], (0,), 3, True, decode=False, state_slot=2, fresh=True),
               RowLayout([4], [7], [9], (1, 2), 8, True, decode=True, state_slot=0, fresh=False),
               RowLayout([5], [0], [-1], (), 1, False, decode=False)]
    states = builder.flatten(layouts, write_kv=True).meta.states
    assert states is not None
    assert states.rows == (StateRow(0, 3, 2, True), StateRow(4, 1, -1, True))
    assert states.step_tokens is not None and states.step_tokens.tolist() == [3]
    assert states.step_slots is not None and states.step_slots.tolist() == [0]
    assert StateRows(()).step_tokens is None


# --- Qwen3-Next: the same trunk, experts with a gated shared expert, grouped projections ---


def hf_next(seed: int = 0, **kw: Any) -> Any:
    torch.manual_seed(seed)
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=24, linear_value_head_dim=20, max_position_embeddings=512, num_experts=6,
                num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=48,
                decoder_sparse_step=1, mlp_only_layers=[1])
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{**base, **kw})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.normal_(0, 0.3)
    return model


def test_qwen3_next_float32_equals_transformers() -> None:
    hf = hf_next()
    model = build(hf)
    assert model.spec.layers[0].mlp.kind == "moe" and model.spec.layers[1].mlp.kind == "dense"
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (90, 5)]
    assert_float32_matches(hf, model, prompts)


def test_qwen3_next_bf16_stays_close() -> None:
    hf = hf_next(1)
    model = build(hf, torch.bfloat16)
    prompt = torch.randint(0, 300, (30,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].softmax(-1)
    got = model.compute_logits(oneshot_hidden(model, [prompt])[0]).softmax(-1)
    assert (got - ref).abs().max() < 0.05


def test_the_random_qwen3_5_shape_builds_and_computes(tmp_path: Any) -> None:
    """The benchmark shape's weights, at a smaller width: every tensor read, finite output."""
    from prelude.testing.random_model import SHAPES, random_hybrid_weights

    cfg = {**SHAPES["qwen3.5-0.8b"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 8, "linear_value_head_dim": 8}
    model = registry.build_model(registry.config_for(cfg), random_hybrid_weights(cfg, dtype=torch.float32),
                                 torch.float32, torch.device("cpu"), None)
    hidden = oneshot_hidden(model, [list(range(20))])[0]
    assert torch.isfinite(model.compute_logits(hidden)).all()


def test_strong_decays_still_match_the_reference() -> None:
    """Per-token log decays of up to -6: within a chunk the decays pass through the range
    whose exp is a subnormal float, which the kernel takes as zero."""
    q, k, v, _, beta, state = _inputs(130, 2, 4, 24, 20, torch.float32, seed=3)
    decay = -torch.rand(1, 130, 4, generator=torch.Generator().manual_seed(4)) * 6
    ref_out, ref_state = hf_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=state,
                                                                  output_final_state=True,
                                                                  use_qk_l2norm_in_kernel=True)
    out, got_state = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(got_state, ref_state, atol=1e-5)
