"""A hybrid (recurrent + attention) model through the engine: greedy tokens and logprobs
equal transformers', chunked prompts carry their state, recurrent-state slots are held by
paged requests only and come back after finishes, aborts and failed steps."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from prelude import LLM, SamplingParams
from prelude.engine.engine import LLMEngine
from prelude.engine.errors import StepFailed
from prelude.engine.request import PoolingParams, PoolingTask
from tests.engine.tiny import VOCAB, hf_tiny_hybrid, tiny_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return hf_tiny_hybrid()


@pytest.fixture
def make_engine(hf_model: Any) -> Iterator:
    made: list[LLMEngine] = []

    def factory(**kw: Any) -> LLMEngine:
        engine = tiny_engine(hf_model, **kw)
        made.append(engine)
        return engine

    yield factory
    for engine in made:  # idle again: every block and every slot back
        engine.check_integrity()
        assert not engine.has_unfinished()
        assert engine.kv.num_available_blocks == engine.kv.pool.num_blocks
        assert engine.kv.num_free_slots == engine.num_state_slots


def hf_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 9, 70, 1, 12)]


@pytest.mark.parametrize("engine_kw", [dict(), dict(max_num_batched_tokens=8), dict(max_recurrent_slots=2),
                                       dict(num_blocks=20, max_num_batched_tokens=16)],
                         ids=["plain", "chunked", "two-slots", "preempting"])
def test_greedy_matches_transformers(hf_model: Any, make_engine: Any, engine_kw: dict[str, Any]) -> None:
    llm = LLM(engine=make_engine(**engine_kw))
    results = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, result in zip(PROMPTS, results):
        assert result.outputs[0].token_ids == hf_greedy(hf_model, prompt, 10)


def test_logprobs_match_transformers(hf_model: Any, make_engine: Any) -> None:
    llm = LLM(engine=make_engine(max_num_batched_tokens=8))
    prompt = list(range(30, 50))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2))[0]
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0], -1)
    for i, lp in enumerate(out.outputs[0].logprobs or []):
        assert abs(lp.logprob - ref[len(prompt) - 1 + i][lp.token_id].item()) < 1e-3


def test_the_start_up_says_slots_and_checkpoints(make_engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        engine = make_engine(max_recurrent_slots=3, max_state_checkpoints=5)
    assert engine.num_state_slots == 3 and engine.kv.prefix is not None
    assert "recurrent state: 3 slots x" in caplog.text
    assert "prefix caching: on, with 5 state checkpoint slots" in caplog.text
    # the state tensors hold the running slots and the checkpoints after them
    conv, rec = engine.runner.kv_caches[0]
    assert conv.shape[0] == rec.shape[0] == 8
    caplog.clear()
    with caplog.at_level("INFO"):
        engine = make_engine(max_recurrent_slots=3, max_state_checkpoints=0)
    assert engine.kv.prefix is None and "prefix caching: off" in caplog.text


def test_oneshot_requests_hold_no_slot_and_run_at_8x_the_slots(hf_model: Any, make_engine: Any) -> None:
    engine = make_engine(max_recurrent_slots=2)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [list(range(3 + i, 3 + i + 5 + i % 7)) for i in range(16)]
    for i, p in enumerate(prompts):
        engine.add_request(f"o{i}", p, one)
    engine.add_request("chat", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    held_by_oneshot = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        held_by_oneshot = max(held_by_oneshot, sum(rid.startswith("o") for rid in engine.kv.holders()))
        engine.check_integrity()
    assert held_by_oneshot == 0
    for i, p in enumerate(prompts):
        assert tokens[f"o{i}"] == hf_greedy(hf_model, p, 1)
    assert tokens["chat"] == hf_greedy(hf_model, PROMPTS[1], 6)


def test_classification_rows_score_without_a_slot(make_engine: Any) -> None:
    engine = make_engine(max_recurrent_slots=1)
    pooling = PoolingParams(PoolingTask.EMBED)
    for i in range(5):
        engine.add_request(f"e{i}", list(range(10, 20 + i)), SamplingParams(max_tokens=0), pooling)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
        assert not engine.kv.holders()
    assert len(done) == 5


def test_aborts_and_failed_steps_give_slots_back(make_engine: Any) -> None:
    engine = make_engine(max_recurrent_slots=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_slots == 0  # three running, the rest wait for a slot
    for i in range(len(PROMPTS)):
        engine.abort(str(i))
    engine.check_integrity()
    assert engine.kv.num_free_slots == 3
    real = engine.runner.launch

    def boom(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("simulated out of memory")

    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(f"f{i}", p, params)
    engine.step()
    engine.step()
    assert engine.kv.num_free_slots == 0  # three decoding, one waiting for a slot
    engine.runner.launch = boom  # type: ignore[method-assign]
    with pytest.raises(StepFailed) as failed:
        engine.step()
    engine.runner.launch = real  # type: ignore[method-assign]
    engine.check_integrity()
    assert len(failed.value.request_ids) == 3
    assert engine.kv.num_free_slots == 3  # the failed step's rows gave theirs back
    while engine.has_unfinished():  # the one left waiting runs to its end
        engine.step()


def test_qwen3_next_greedy_matches_transformers_through_chunks_and_slots() -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=24,
        linear_value_head_dim=20, max_position_embeddings=512, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, eos_token_id=256)
    hf = transformers.Qwen3NextForCausalLM(cfg).float().eval()
    engine = tiny_engine(hf, max_num_batched_tokens=8, max_recurrent_slots=2)
    results = LLM(engine=engine).generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for prompt, result in zip(PROMPTS[:4], results):
        assert result.outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    engine.check_integrity()
    assert engine.kv.num_free_slots == 2


def test_a_saved_checkpoint_starts_through_the_loader(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A Qwen3.5 checkpoint directory (safetensors, config.json, a tokenizer) served as a
    user starts it: through the loader and the registry, the start-up log saying the slots."""
    import shutil

    from prelude.model.loading.files import load_model_files

    source = load_model_files(None).model_dir  # the default model's tokenizer
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    hf = transformers.Qwen3_5ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp_path / name)
    with caplog.at_level("INFO"):
        llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory_gib=0.01, max_num_seqs=4)
    assert "recurrent state: 4 slots x" in caplog.text and "state checkpoint slots" in caplog.text
    prompt = [11, 12, 13, 14, 15]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 4)


def test_prompt_logprobs_of_a_oneshot_row_match_transformers(hf_model: Any, make_engine: Any) -> None:
    engine = make_engine()
    prompt = list(range(40, 60))
    engine.add_request("p", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            got = out.prompt_logprobs if out.prompt_logprobs is not None else got
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], -1)
    assert got is not None and got[0] is None and len(got) == len(prompt)
    for i, lp in enumerate(got[1:], start=1):
        assert lp is not None and abs(lp.logprob - ref[i - 1][prompt[i]].item()) < 1e-3
