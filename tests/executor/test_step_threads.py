"""Small CPU steps run their forward on one thread; larger ones keep the whole team."""

from __future__ import annotations

import types

import pytest
import torch

from prelude.executor.step_threads import SMALL_STEP_FLOPS, StepThreads, decoder_flops


def _tiny_cfg() -> object:
    return types.SimpleNamespace(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=49152)


def test_decoder_flops_counts_projections_and_head() -> None:
    per_token, per_row = decoder_flops(_tiny_cfg())
    assert per_token == 2 * 2 * (128 * 32 * (8 + 4) + 3 * 128 * 256)
    assert per_row == 2 * 128 * 49152


def test_small_step_runs_on_one_thread_and_restores_the_team() -> None:
    team = torch.get_num_threads()
    if team < 2:
        torch.set_num_threads(2)
    try:
        threads = StepThreads(torch.device("cpu"), *decoder_flops(_tiny_cfg()))
        assert threads.is_small(128, 1) and not threads.is_small(4096, 32)
        with threads.for_step(128, 1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == max(2, team)
        with threads.for_step(4096, 32):
            assert torch.get_num_threads() == max(2, team)
        with pytest.raises(RuntimeError), threads.for_step(1, 1):
            raise RuntimeError("a failed forward")
        assert torch.get_num_threads() == max(2, team)  # restored on failure too
    finally:
        torch.set_num_threads(team)


def test_default_model_shape_is_never_small() -> None:
    smol = types.SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                 num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152)
    per_token, _ = decoder_flops(smol)
    assert per_token > SMALL_STEP_FLOPS  # one decode row of SmolLM2-135M keeps every thread


def test_an_unreadable_config_keeps_the_team() -> None:
    team = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert StepThreads(torch.device("cpu"), *decoder_flops(_tiny_cfg())).enabled
        assert not StepThreads(torch.device("cpu"), *decoder_flops(types.SimpleNamespace())).enabled
    finally:
        torch.set_num_threads(team)
