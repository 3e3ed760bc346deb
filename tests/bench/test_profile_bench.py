"""`prelude bench profile`: a profiled run's time lands in the right category, and the
labels it puts around projections, attention and the fused kernels are taken off after."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prelude.bench.profile_bench import CATEGORIES, _ab_decode_loop, _ab_last_layer, labelled, profile_steps
from prelude.kernels.cpu.cpu_fused import CpuFusedKernels
from prelude.model.layers.linear import Projection


class _Attention:
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q)


class _Model:
    def __init__(self) -> None:
        self.attention = _Attention()


def test_categories_follow_the_labelled_calls() -> None:
    model = _Model()
    proj = Projection(torch.randn(256, 256))
    x, q = torch.randn(64, 256), torch.randn(1, 4, 64, 32)

    def run() -> int:
        for _ in range(3):
            y = proj(x)  # gemm (labelled while profiling)
            model.attention.forward(q)  # attention (labelled)
            F.silu(y) * y  # eager elementwise ops
        return 3

    res = profile_steps(run, model)
    ms = res["ms_per_forward"]
    assert set(ms) == set(CATEGORIES) and res["forwards"] == 3
    assert ms["gemm"] > 0 and ms["attention"] > 0 and ms["elementwise"] > 0
    assert sum(ms.values()) <= res["wall_ms_per_forward"] * 1.05
    assert any(name in ("aten::mm", "aten::linear", "aten::addmm") for name, _ in res["top_ops_ms"]["gemm"])


def test_labels_are_taken_off() -> None:
    model = _Model()
    call, rms = Projection.__call__, CpuFusedKernels.rms_norm
    with labelled(model):
        assert Projection.__call__ is not call and "forward" in vars(model.attention)
    assert Projection.__call__ is call and CpuFusedKernels.rms_norm is rms
    assert "forward" not in vars(model.attention)


def test_last_layer_ab_alternates_the_runners_choice_and_restores_it() -> None:
    class Runner:
        prune_last_layer = True

    class Engine:
        runner = Runner()

    engine = Engine()
    seen: list[tuple[bool, int]] = []

    def prefill_run(prompts: list[list[int]]):  # noqa: ANN202
        def run() -> int:
            seen.append((engine.runner.prune_last_layer, prompts[0][0]))
            return 1
        return run

    res = _ab_last_layer(engine, prefill_run, [[i] for i in range(6)])
    assert seen == [(i % 2 == 1, i) for i in range(6)]
    assert engine.runner.prune_last_layer is True
    assert len(res["off"]["ms"]) == len(res["on"]["ms"]) == 3 and res["on"]["median_ms"] >= 0


def test_decode_loop_ab_alternates_the_c_and_the_python_layer_loop() -> None:
    class Model:
        layer_loop: object = None

    model, c_loop = Model(), object()
    seen: list[object] = []
    res = _ab_decode_loop(model, c_loop, lambda: seen.append(model.layer_loop), 3)
    assert seen == [c_loop, None] * 3
    assert res["c_median_ms"] >= 0 and res["python_median_ms"] >= 0


def test_a_judge_wave_hands_every_prompt_over_before_the_first_step() -> None:
    from prelude.bench.profile_bench import judge_wave

    class Engine:
        def __init__(self) -> None:
            self.waiting: list[list[int]] = []
            self.added: list[tuple[str, list[int]]] = []
            self.steps: list[int] = []

        def add_request(self, rid: str, ids: list[int], params: object) -> None:
            self.added.append((rid, ids))
            self.waiting.append(ids)

        def has_unfinished(self) -> bool:
            return bool(self.waiting)

        def step(self) -> None:  # at most 3 requests a step
            self.steps.append(len(self.waiting))
            del self.waiting[:3]

    engine, shared = Engine(), [7, 8, 9]
    suffixes = [[i, i + 1] for i in range(7)]
    assert judge_wave(engine, shared, suffixes, None, iter(range(100))) == 3  # steps until all answered
    assert [ids for _, ids in engine.added] == [shared + s for s in suffixes]
    assert engine.steps == [7, 4, 1]  # all 7 waiting at the first step
    assert len({rid for rid, _ in engine.added}) == 7


def test_a_profile_without_decode_steps_runs() -> None:
    """--decode-steps 0 (a judge-only profile): no decode A/B of the C layer loop (which the
    default model has in float32 wherever the C kernels build) to take a median of."""
    from prelude.bench.profile_bench import run_dtype

    res = run_dtype("float32", None, prefills=1, prompt_tokens=16, decode_rows=1, decode_steps=0, seed=0)
    assert "decode_c_loop" not in res and res["prefill"]
