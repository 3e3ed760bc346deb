"""The bfloat16-bounded greedy head (head_argmax.c): the token of the float32 logits'
argmax, bit for bit, without the logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prelude import SamplingParams
from prelude.kernels.cpu.row_argmax import row_argmax
from prelude.kernels.cpu.head_argmax import HeadArgmax
from prelude.model.fast_paths.greedy_head import head_argmax_for, serves
from prelude.model.layers.linear import Projection
from prelude.kernels.cpu.row_gemv import load_row_gemv

from tests.engine.tiny import hf_tiny_llama, tiny_engine


def _head(out: int, k: int, seed: int) -> tuple[Projection, HeadArgmax]:
    torch.manual_seed(seed)
    w = torch.randn(out, k) * 0.02
    w[out - 3] = w[11]  # an exact tie: the lower id wins
    w[40] = w[41] * (1 + 2**-23)  # a near one
    head = Projection(w, None, prepack=True, head=True)
    found = head_argmax_for(head)
    if found is None or load_row_gemv() is None:
        pytest.skip("no AVX-512 BF16, no C compiler or no row GEMV: the logits decide")
    return head, found


@pytest.mark.parametrize("out,k", [(8200, 128), (16_390, 64), (4100, 256)])
def test_the_argmax_of_the_logits_the_head_computes(out: int, k: int) -> None:
    head, greedy = _head(out, k, seed=out)
    with torch.inference_mode():
        for trial in range(48):
            rows = 1 + trial % 16 if trial % 4 else 17 + trial % 48
            x = torch.randn(rows, k) * (0.5 + trial % 4)
            x[0] = head.weight[11] * 40  # aims at the tied pair
            x[-1] = head.weight[41] * 40  # and at the near one
            assert serves(head, x)
            logits = head(x).float()
            for limit in (out, out - 5, 300):
                assert torch.equal(greedy.argmax(x, limit), row_argmax(logits[:, :limit].contiguous()))
    assert greedy.argmax(x[:2], out)[0] == 11  # type: ignore[possibly-undefined]


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_the_bfloat16_pass_split_over_threads_gives_the_logits_argmax(threads: int) -> None:
    """29,000 tokens are 1,813 blocks: up to 7 spans of at least 256 (odd sizes, the last
    one odd), each row count on both sides of the paired form (<= 8 rows), rows aimed at
    the first and last blocks of spans, limits inside the first, a middle and the last
    span."""
    head, greedy = _head(29_000, 64, seed=threads)
    # the first token of each 7-thread span's first block, its 2- and 3-thread peers, and
    # the last block's tokens (the last block runs unpaired)
    targets = [28_999, 0, 4128, 8288, 9664, 12_416, 14_496, 16_576, 19_328, 20_704, 24_864, 28_992, 4127, 14_495]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for rows in (1, 3, 8, 9, 16):
                for first in range(0, len(targets), rows):
                    x = torch.randn(rows, 64) * 2
                    for r, token in enumerate(targets[first : first + rows]):
                        x[r] = head.weight[token] * 40
                    logits = head(x).float()
                    for limit in (29_000, 28_995, 15_001, 300):
                        assert torch.equal(greedy.argmax(x, limit), row_argmax(logits[:, :limit].contiguous()))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 3])
def test_rows_whose_every_token_stays_a_candidate(threads: int) -> None:
    """A zero row bounds every logit at 0 +- 2^-100, so every token below the limit is kept
    by the bfloat16 pass (the candidates' worst case: every span's list full) and the first
    one wins, as argmax's ties do; rows beside it keep their own tokens."""
    head, greedy = _head(29_000, 64, seed=9)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for rows in (1, 5, 16):
                x = torch.randn(rows, 64) * 2
                x[0] = 0.0
                x[-1] = 0.0
                logits = head(x).float()
                for limit in (29_000, 15_001, 17):
                    found = greedy.argmax(x, limit)
                    assert torch.equal(found, row_argmax(logits[:, :limit].contiguous()))
                    assert found[0] == 0 and found[-1] == 0
    finally:
        torch.set_num_threads(before)


def test_more_than_16_rows_go_16_at_a_time() -> None:
    """Each chunk's token is its own logits' argmax (a chunk of one row summed as the one-row
    kernel sums): what a head called 16 rows at a time would give."""
    head, greedy = _head(8200, 128, seed=6)
    x = torch.randn(33, 128)
    with torch.inference_mode():
        logits = torch.cat([head(chunk).float() for chunk in x.split(16)])
        assert torch.equal(greedy.argmax(x, 8200), row_argmax(logits))


def test_declines_a_row_that_is_not_finite() -> None:
    head, greedy = _head(8200, 128, seed=1)
    x = torch.randn(3, 128)
    x[1, 5] = float("nan")
    assert greedy.argmax(x, 8200) is None
    x[1, 5] = float("inf")
    assert greedy.argmax(x, 8200) is None


def test_serves_only_what_the_row_gemv_kernels_compute() -> None:
    head, _ = _head(8200, 128, seed=2)
    assert serves(head, torch.randn(1, 128)) and serves(head, torch.randn(64, 128))
    assert not serves(head, torch.randn(65, 128))  # past 64 rows: oneDNN or MKL
    wide, _ = _head(4100, 320, seed=4)
    assert serves(wide, torch.randn(2, 320))
    assert not serves(wide, torch.randn(1, 320))  # one row of 320: oneDNN, not the one-row kernel
    assert not serves(wide, torch.randn(17, 320))  # ... nor a last chunk of one
    assert not serves(head, torch.randn(4, 128, dtype=torch.bfloat16))
    small = Projection(torch.randn(300, 128), None, prepack=True, head=True)  # below the row GEMV's size
    assert not serves(small, torch.randn(4, 128))


def test_engine_greedy_tokens_are_the_logits_argmax() -> None:
    """Greedy decodes of 1..16 rows through a head the kernel serves: the same tokens as
    with the logits computed and argmaxed, and the kernel did serve them."""
    pytest.importorskip("transformers")
    hf = hf_tiny_llama(seed=3, vocab_size=16_448)  # 16,448 x 64 float32: a row GEMV head
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1 + i, 20 + 3 * i, 30, 40 + i][: 2 + i % 3] for i in range(9)]

    def run(use_kernel: bool) -> tuple[list[list[int]], int]:
        engine = tiny_engine(hf, max_num_seqs=16)
        model: Any = engine.runner.model
        real, served = model.greedy_token_ids, [0]

        def greedy(hidden: torch.Tensor, limit: int | None) -> torch.Tensor | None:
            ids = real(hidden, limit) if use_kernel else None
            served[0] += ids is not None
            return ids

        model.greedy_token_ids = greedy
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
        return list(tokens.values()), served[0]

    with_kernel, served = run(True)
    if served == 0:
        pytest.skip("no AVX-512 BF16, no C compiler or no row GEMV on this CPU")
    assert run(False) == (with_kernel, 0)
    assert all(len(t) == 12 for t in with_kernel)
