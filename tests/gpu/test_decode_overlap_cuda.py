"""Decode overlap on CUDA (marked `gpu`): the overlapped loop (the default there) launches
carried rows, their inputs carried on the device; greedy and seeded outputs
equal the plain loop's, with and without CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from prelude.params import SamplingParams
from tests.engine.test_decode_overlap import _Carried, _run
from tests.engine.tiny import ByteTokenizer, hf_tiny_llama, tiny_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("eager", [True, False])
def test_overlapped_decode_on_cuda_matches_the_plain_loop(eager: bool) -> None:
    hf = hf_tiny_llama()
    requests = {
        "greedy": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        "stop": SamplingParams(max_tokens=24, temperature=0.8, seed=2, stop=("a",)),
        "logprobs": SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
    }
    make = dict(device="cuda", tokenizer=ByteTokenizer(), enforce_eager=eager)
    want = _run(tiny_engine(hf, overlap=False, **make), requests)  # type: ignore[arg-type]
    engine = tiny_engine(hf, overlap=None, **make)  # type: ignore[arg-type]
    assert engine.overlap  # on by default with CUDA
    carried = _Carried(engine)
    got = _run(engine, requests)
    for rid in requests:
        assert got[rid][:3] == want[rid][:3], rid
    assert {"greedy", "seeded", "logprobs"} <= carried.ids
