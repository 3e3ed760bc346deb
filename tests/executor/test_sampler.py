"""The device sampler: counter-based seeds, exact distribution, filters and penalties."""

from __future__ import annotations

import math

import torch

from prelude.executor.sampler import sample, uniform_noise
from prelude.forward_batch import SampleSpec
from prelude.params import SamplingParams


def _spec(seed: int = 0, outputs: list[int] | None = None, prompt: list[int] | None = None, **kw: object) -> SampleSpec:
    return SampleSpec(SamplingParams(**kw), prompt or [], outputs or [], seed)  # type: ignore[arg-type]


def test_noise_is_a_pure_function_of_seed_position_and_token() -> None:
    seeds = torch.tensor([1, 2, 1], dtype=torch.long)
    pos = torch.tensor([0, 0, 0], dtype=torch.long)
    u = uniform_noise(seeds, pos, 1000)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02  # uniform on (0, 1)
    assert not torch.equal(u[0], uniform_noise(seeds[:1], torch.tensor([1]), 1000)[0])  # next position differs


def test_a_seeded_draw_does_not_depend_on_the_rest_of_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    alone = sample(logits[1:2], [_spec(seed=7, temperature=1.0)])[0].token_id
    batched = sample(logits, [_spec(seed=3, temperature=0.7), _spec(seed=7, temperature=1.0), _spec(temperature=0)])
    assert batched[1].token_id == alone
    assert batched[2].token_id == int(logits[2].argmax())


def test_exponential_race_samples_the_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(-1)[0]
    n = 4000
    counts = torch.zeros(4)
    for s in range(n):
        counts[sample(logits, [_spec(seed=s, temperature=1.0)])[0].token_id] += 1
    for i in range(4):  # within 4 standard deviations of the binomial
        sd = math.sqrt(n * probs[i] * (1 - probs[i]))
        assert abs(counts[i] - n * probs[i]) < 4 * sd


def test_top_k_top_p_and_min_p_restrict_the_support() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -2.0]])
    seen_k = {sample(logits, [_spec(seed=s, temperature=1.0, top_k=2)])[0].token_id for s in range(200)}
    assert seen_k == {0, 1}
    seen_p = {sample(logits, [_spec(seed=s, temperature=1.0, top_p=0.5)])[0].token_id for s in range(200)}
    assert seen_p == {0}
    seen_min = {sample(logits, [_spec(seed=s, temperature=1.0, min_p=0.5)])[0].token_id for s in range(200)}
    assert seen_min == {0, 1}


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample(logits, [_spec(temperature=0)])[0].token_id == 0
    assert sample(logits, [_spec(temperature=0, outputs=[0], frequency_penalty=0.5)])[0].token_id == 1
    assert sample(logits, [_spec(temperature=0, outputs=[0, 0], presence_penalty=0.2)])[0].token_id == 1
    assert sample(logits, [_spec(temperature=0, prompt=[0], repetition_penalty=1.2)])[0].token_id == 1


def test_logprobs_come_from_the_raw_distribution_with_top_alternatives() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    out = sample(logits, [_spec(temperature=0, logprobs=2), _spec(temperature=0)])
    raw = torch.log_softmax(logits, -1)
    assert out[0].token_id == 1 and out[0].logprob is not None
    assert abs(out[0].logprob.logprob - float(raw[0, 1])) < 1e-6
    assert [t for t, _ in out[0].logprob.top] == [1, 2]
    assert out[1].logprob is None and out[1].token_id == 2


def test_cpu_prefix_truncation_draws_what_the_full_sort_draws(monkeypatch) -> None:  # noqa: ANN001
    """CPU steps keep top-k / top-p inside each row's best TRUNCATE_PREFIX tokens when they
    can (and sort the row when they cannot): the same tokens as the full sort."""
    import prelude.executor.sampler as sampler

    gen = torch.Generator().manual_seed(0)
    cases = [((torch.randn(6, 2000, generator=gen) * 4), dict(top_p=0.9), True),  # peaked: the prefix holds it
             ((torch.randn(6, 2000, generator=gen) * 4), dict(top_k=40, top_p=0.95), True),
             ((torch.randn(6, 2000, generator=gen)), dict(top_k=50), True),
             ((torch.randn(6, 2000, generator=gen)), dict(top_p=0.9), False)]  # flat: past the prefix, sorted
    prefix = sampler._prefix_probs
    for logits, kw, in_prefix in cases:
        specs = [_spec(seed=s, temperature=0.8, **kw) for s in range(6)] + [_spec(temperature=0)]
        rows = torch.cat([logits, logits[:1]])
        found: list[bool] = []
        monkeypatch.setattr(sampler, "_prefix_probs", lambda *a: found.append((r := prefix(*a)) is not None) or r)
        fast = [t.token_id for t in sample(rows, specs)]
        assert found == [in_prefix]
        monkeypatch.setattr(sampler, "TRUNCATE_PREFIX", 10**9)  # every row through the full sort
        full = [t.token_id for t in sample(rows, specs)]
        monkeypatch.undo()
        assert fast == full
        assert fast[-1] == int(logits[0].argmax())  # the greedy row beside them
