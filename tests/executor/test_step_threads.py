"""Small CPU trunks and heads run on one thread; larger ones keep the whole team."""

from __future__ import annotations

import types

import pytest
import torch

from prelude.executor.step_threads import SMALL_STEP_FLOPS, StepThreads, decoder_flops


def _tiny_cfg() -> object:
    return types.SimpleNamespace(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=49152)


def _smol_cfg() -> object:
    return types.SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                 num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152)


@pytest.fixture
def team() -> int:
    """A team of at least two threads for the test, the caller's restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield torch.get_num_threads()
    torch.set_num_threads(before)


def test_decoder_flops_counts_projections_and_head() -> None:
    per_token, per_row = decoder_flops(_tiny_cfg())
    assert per_token == 2 * 2 * (128 * 32 * (8 + 4) + 3 * 128 * 256)
    assert per_row == 2 * 128 * 49152


def test_small_trunk_runs_on_one_thread_and_restores_the_team(team: int) -> None:
    threads = StepThreads(torch.device("cpu"), *decoder_flops(_tiny_cfg()))
    assert threads.trunk_is_small(128) and not threads.trunk_is_small(4096)
    with threads.for_trunk(128):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == team
    with threads.for_trunk(4096):
        assert torch.get_num_threads() == team
    with pytest.raises(RuntimeError), threads.for_trunk(1):
        raise RuntimeError("a failed forward")
    assert torch.get_num_threads() == team  # restored on failure too


def test_heads_of_a_small_trunk_keep_one_thread_until_many_rows_sample(team: int) -> None:
    threads = StepThreads(torch.device("cpu"), *decoder_flops(_tiny_cfg()))
    # Decode of the free model: 8 rows through its 49,152-row head stay on one thread
    # (trunk and head alike); 64 rows give the head the team, the trunk stays on one.
    with threads.for_heads(8, 8):
        assert torch.get_num_threads() == 1
    assert threads.trunk_is_small(64) and not threads.heads_are_small(64, 64)
    with threads.for_heads(64, 64):
        assert torch.get_num_threads() == team
    # A trunk big enough to split gives its heads the team, however few rows sample.
    assert not threads.heads_are_small(4096, 1)


def test_default_model_shape_is_never_small(team: int) -> None:
    threads = StepThreads(torch.device("cpu"), *decoder_flops(_smol_cfg()))
    per_token, _ = decoder_flops(_smol_cfg())
    assert per_token > SMALL_STEP_FLOPS  # one decode row of SmolLM2-135M keeps every thread
    assert not threads.trunk_is_small(1) and not threads.heads_are_small(1, 1)
    with threads.for_trunk(1), threads.for_heads(1, 1):
        assert torch.get_num_threads() == team


def test_an_unreadable_config_keeps_the_team(team: int) -> None:
    assert StepThreads(torch.device("cpu"), *decoder_flops(_tiny_cfg())).enabled
    threads = StepThreads(torch.device("cpu"), *decoder_flops(types.SimpleNamespace()))
    assert not threads.enabled
    with threads.for_trunk(1), threads.for_heads(1, 1):
        assert torch.get_num_threads() == team
