"""Small CPU trunks and heads run on one thread; larger ones keep the whole team."""

from __future__ import annotations

import types

import pytest
import torch

import prelude.executor.step_threads as step_threads
from prelude.executor.step_threads import SMALL_STEP_FLOPS, TINY_MODEL_FLOPS, StepThreads, decoder_flops


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


@pytest.fixture
def no_tiny_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The size bounds alone, for the small test shapes (which are all tiny models)."""
    monkeypatch.setattr(step_threads, "TINY_MODEL_FLOPS", 0.0)


class _Probe:
    def __init__(self, quiet: bool) -> None:
        self.answer = quiet
        self.events: list[str] = []

    def quiet(self) -> bool:
        return self.answer

    def step_began(self) -> None:
        self.events.append("began")

    def step_ended(self) -> None:
        self.events.append("ended")


def test_a_tiny_model_runs_every_step_on_one_thread_while_the_machine_is_busy(team: int) -> None:
    """The free model (below TINY_MODEL_FLOPS a token), other work on the machine: a 32 x
    128-token OneShot step and 64 sampled rows run on one thread; SmolLM2's shape is not tiny."""
    per_token, _ = decoder_flops(_tiny_cfg())
    assert per_token < TINY_MODEL_FLOPS < decoder_flops(_smol_cfg())[0]
    threads = StepThreads(torch.device("cpu"), *decoder_flops(_tiny_cfg()), spare=_Probe(quiet=False))
    assert threads.trunk_is_small(32 * 128) and threads.heads_are_small(32 * 128, 64)
    with threads.for_trunk(32 * 128):
        assert torch.get_num_threads() == 1
    with threads.for_heads(64, 64):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == team
    assert not StepThreads(torch.device("cpu"), *decoder_flops(_smol_cfg())).tiny_model


def test_a_tiny_model_on_a_quiet_machine_splits_every_step(team: int) -> None:
    """Quiet, a tiny model's steps take the team whatever their size (the free model's c=1
    128-token step, in process: 1.04 ms on one thread, 0.80 on two), a single decode row
    and its head included; when the machine turns busy the next step is on one thread."""
    probe = _Probe(quiet=True)
    threads = StepThreads(torch.device("cpu"), *decoder_flops(_tiny_cfg()), spare=probe)
    for tokens, rows in ((32 * 128, 64), (128, 1), (1, 1)):
        assert not threads.trunk_is_small(tokens) and not threads.heads_are_small(tokens, rows)
    with threads.for_trunk(128), threads.for_heads(128, 1):
        assert torch.get_num_threads() == team
    probe.answer = False
    with threads.for_trunk(32 * 128):
        assert torch.get_num_threads() == 1


def test_a_measured_step_brackets_trunk_and_heads_for_the_probe(team: int) -> None:
    """The probe hears where each step begins and ends (its in-step measure of the event
    loop), a failed step included; a model without a probe measures nothing."""
    probe = _Probe(quiet=False)
    threads = StepThreads(torch.device("cpu"), *decoder_flops(_tiny_cfg()), spare=probe)
    with threads.measured_step():
        assert probe.events == ["began"]
    with pytest.raises(RuntimeError), threads.measured_step():
        raise RuntimeError("a failed forward")
    assert probe.events == ["began", "ended", "began", "ended"]
    with StepThreads(torch.device("cpu"), *decoder_flops(_smol_cfg())).measured_step():
        pass
    assert torch.get_num_threads() == team


def test_only_a_tiny_model_measures_the_machine() -> None:
    assert StepThreads(torch.device("cpu"), *decoder_flops(_smol_cfg())).spare is None
    assert StepThreads(torch.device("meta"), *decoder_flops(_tiny_cfg())).spare is None


def test_small_trunk_runs_on_one_thread_and_restores_the_team(team: int, no_tiny_rule: None) -> None:
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


def test_heads_of_a_small_trunk_keep_one_thread_until_many_rows_sample(team: int, no_tiny_rule: None) -> None:
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


def test_a_decode_step_runs_its_trunk_and_heads_on_the_threads_they_were_given(
        team: int, monkeypatch, no_tiny_rule: None) -> None:  # noqa: ANN001
    """Through ModelRunner.launch: a tiny model's trunk on one thread; its heads on one
    thread while few rows sample, on the team once the sampled rows' head work is large."""
    from prelude.engine.request import SamplingParams
    from tests.engine.tiny import hf_tiny_llama, tiny_engine

    engine = tiny_engine(hf_tiny_llama())
    runner = engine.runner
    seen: dict[str, set[int]] = {"trunk": set(), "heads": set()}
    forward, logits = runner.forward, runner.model.compute_logits

    def trunk(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen["trunk"].add(torch.get_num_threads())
        return forward(*args, **kwargs)

    def heads(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen["heads"].add(torch.get_num_threads())
        return logits(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", trunk)
    monkeypatch.setattr(runner.model, "compute_logits", heads)

    def decode(rows: int) -> None:
        for i in range(rows):
            engine.add_request(f"r{rows}-{i}", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
        while engine.has_unfinished():
            engine.step()

    decode(2)
    assert seen == {"trunk": {1}, "heads": {1}}
    # The head's bound lowered below 8 sampled rows: those heads take the team, the trunk stays.
    monkeypatch.setattr(step_threads, "SMALL_HEAD_FLOPS", 4 * runner.step_threads.flops_per_logit_row)
    seen = {"trunk": set(), "heads": set()}
    decode(8)
    assert seen["trunk"] == {1} and team in seen["heads"]


def test_every_launched_step_is_bracketed_for_the_probe(team: int, monkeypatch) -> None:  # noqa: ANN001
    """Through ModelRunner.launch: the probe hears each step begin before its trunk runs and
    end after its heads, once a step."""
    from prelude.engine.request import SamplingParams
    from tests.engine.tiny import hf_tiny_llama, tiny_engine

    engine = tiny_engine(hf_tiny_llama())
    runner = engine.runner
    probe = _Probe(quiet=False)
    monkeypatch.setattr(runner.step_threads, "spare", probe)
    forward, logits = runner.forward, runner.model.compute_logits
    monkeypatch.setattr(runner, "forward", lambda *a, **k: (probe.events.append("trunk"), forward(*a, **k))[1])
    monkeypatch.setattr(runner.model, "compute_logits",
                        lambda *a, **k: (probe.events.append("heads"), logits(*a, **k))[1])
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert probe.events == ["began", "trunk", "heads", "ended"] * 3 and steps == 3
