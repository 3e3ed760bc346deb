"""Multi-item rows on the Triton attention backend (interpreted on the CPU) give the torch
backend's answers: the runner's segment ids reach the prefill kernel, and segmented
batches never replay a captured graph (graphs take no segment ids)."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
from typing import Any, Callable, Iterator

import pytest
import torch

# Not imported here: the spawned worker imports this module before its initializer sets
# TRITON_INTERPRET, and triton reads it once, on import.
if importlib.util.find_spec("triton") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs triton and transformers", allow_module_level=True)


def _enter_interpreter() -> None:
    assert "triton" not in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def interp() -> Iterator[Callable[..., Any]]:
    with multiprocessing.get_context("spawn").Pool(1, initializer=_enter_interpreter) as pool:
        yield lambda fn, *args: pool.apply(fn, args)


def check_multi_item_matches_torch_backend() -> dict[str, list[float]]:
    from prelude.executor.graphs import Capture, GraphConfig
    from prelude.params import PoolingParams, PoolingTask, SamplingParams
    from tests.engine.tiny import hf_tiny_llama, tiny_engine

    assert os.environ.get("TRITON_INTERPRET") == "1"
    hf = hf_tiny_llama()
    results = []
    for backend in ("triton", "torch"):
        engine = tiny_engine(hf, attention_backend=backend, max_num_batched_tokens=256)
        if backend == "triton":
            engine.runner.capture_graphs(engine.max_model_len, Capture.EMULATE, GraphConfig(
                decode_batch_sizes=(4,), prefill_token_sizes=(64,), max_prefill_rows=4))
        query = list(range(60, 78))
        items = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
        packed = PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3), item_lens=(3, 5, 1))
        whole = PoolingParams(PoolingTask.SEQUENCE_LOGPROBS, item_lens=(3, 5, 1))
        got: dict[str, list[float]] = {}
        for rnd in range(2):  # the second round hits the cached query
            engine.add_request(f"p{rnd}", query + [t for i in items for t in i], SamplingParams(max_tokens=0), packed)
            engine.add_request(f"w{rnd}", query[:9] + [t for i in items for t in i], SamplingParams(max_tokens=0),
                               whole)
            while engine.has_unfinished():
                for o in engine.step():
                    got[o.request_id] = list(o.scores or ())
        engine.check_integrity()
        results.append(got)
    tri, ref = results
    for key in ref:
        torch.testing.assert_close(torch.tensor(tri[key]), torch.tensor(ref[key]), atol=1e-4, rtol=1e-4)
    return tri


def test_multi_item_on_triton_matches_torch(interp: Callable[..., Any]) -> None:
    out = interp(check_multi_item_matches_torch_backend)
    assert len(out["p1"]) == 9 and len(out["w1"]) == 3


def check_fused_step_matches_torch_backend() -> dict[str, list[float]]:
    """Decode rows, a multi-item OneShot row (cold, then on its cached query) and a plain
    OneShot row in fused steps: the Triton backend (with emulated graphs) takes the
    combined metadata."""
    from prelude.forward_batch import MixedBatch
    from prelude.params import PoolingParams, PoolingTask, SamplingParams
    from tests.engine.tiny import hf_tiny_llama, tiny_engine

    from prelude.executor.graphs import Capture, GraphConfig

    hf = hf_tiny_llama()
    results = []
    for backend in ("triton", "torch"):
        engine = tiny_engine(hf, attention_backend=backend, max_num_batched_tokens=256)
        if backend == "triton":  # fused steps without segments may replay a captured graph
            engine.runner.capture_graphs(engine.max_model_len, Capture.EMULATE, GraphConfig(
                decode_batch_sizes=(4,), prefill_token_sizes=(64,), max_prefill_rows=4))
        fused = []
        launch = engine.runner.launch

        def spy(batch: Any, *rest: Any, launch: Any = launch, fused: list[Any] = fused) -> Any:
            if isinstance(batch, MixedBatch) and batch.oneshot_rows and batch.decode_rows:
                fused.append(batch)
            return launch(batch, *rest)

        engine.runner.launch = spy  # type: ignore[method-assign]
        got: dict[str, list[float]] = {}
        for i in range(2):
            engine.add_request(f"d{i}", list(range(30 + i, 40 + 2 * i)),
                               SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        query = list(range(60, 78))
        packed = PoolingParams(PoolingTask.LABELS, label_token_ids=(1, 2, 3), item_lens=(3, 5, 1))
        def collect() -> None:
            for o in engine.step():
                if o.scores is not None:
                    got[o.request_id] = list(o.scores)
                else:
                    got.setdefault(o.request_id, []).extend(float(t) for t in o.new_token_ids)

        collect()  # the decodes' prompts
        for rnd in range(2):  # the second round hits the cached query
            engine.add_request(f"p{rnd}", query + list(range(1, 10)), SamplingParams(max_tokens=0), packed)
            engine.add_request(f"l{rnd}", list(range(90, 97 + rnd)), SamplingParams(max_tokens=0),
                               PoolingParams(PoolingTask.LABELS, label_token_ids=(4, 5)))
            collect()
        while engine.has_unfinished():
            collect()
        engine.check_integrity()
        assert len(fused) >= 2
        results.append(got)
    tri, ref = results
    assert tri.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(torch.tensor(tri[key], dtype=torch.float64),
                                   torch.tensor(ref[key], dtype=torch.float64), atol=1e-4, rtol=1e-4)
    return tri


def test_fused_step_on_triton_matches_torch(interp: Callable[..., Any]) -> None:
    out = interp(check_fused_step_matches_torch_backend)
    assert len(out["p1"]) == 9 and len(out["l1"]) == 2 and len(out["d0"]) == 4
