"""ExecutorConfig.pack_at_start: a bf16 decoder's prepacked projections get their packed
copies at start (amx_gemm.c's while the runner is built, oneDNN's by a thread it starts), so
that its first prompt makes none."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prelude.config import ExecutorConfig
from prelude.executor.runner import ModelRunner
from prelude import SamplingParams
from prelude.forward_batch import OneShotBatch, OneShotRow, SampleSpec
from prelude.model.layers.linear import Projection
from prelude.model.registry import config_for
from tests.engine.tiny import hf_tiny_llama
from tests.model.test_linear import _cpu_can_prepack_bf16


def _runner(dtype: str, pack_at_start: bool) -> ModelRunner:
    hf = hf_tiny_llama()
    config = config_for(hf.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return ModelRunner.create(config, weights, ExecutorConfig(device="cpu", dtype=dtype, pack_at_start=pack_at_start), 4)


def _packed(runner: ModelRunner) -> list[bool]:
    """Per projection (each layer's qkv, o_proj, gate_up, down, then the LM head): whether it
    holds its oneDNN copy, once the thread making them is done."""
    thread = runner.model._copies_thread  # type: ignore[attr-defined]
    if thread is not None:
        thread.join()
    return [p._packed is not None for p in runner.model._projections()]  # type: ignore[attr-defined]


def test_the_first_forward_waits_for_the_copies_made_by_the_thread(monkeypatch) -> None:  # noqa: ANN001
    """oneDNN's copies come from a thread so that start-up does not wait for them; the first
    forward does, so that a process holds them all from its first answer on."""
    if not _cpu_can_prepack_bf16():
        pytest.skip("this CPU cannot prepack bf16 weights (needs AVX-512): no copies to make")
    release = threading.Event()
    real = Projection.make_packed_copy

    def held(self):  # noqa: ANN001, ANN202
        release.wait(10)
        return real(self)

    monkeypatch.setattr(Projection, "make_packed_copy", held)
    runner = _runner("bfloat16", pack_at_start=True)
    thread = runner.model._copies_thread  # type: ignore[attr-defined]
    assert thread is not None and thread.is_alive()  # start-up returned before the copies
    threading.Timer(0.2, release.set).start()
    runner.allocate_kv_cache(8)
    sample = SampleSpec(SamplingParams(temperature=0.0), [5, 6, 7], [])
    result = runner.launch(OneShotBatch((OneShotRow("x", [5, 6, 7], sample, None),))).wait()
    assert set(result.sampled) == {"x"}
    assert not thread.is_alive() and runner.model._copies_thread is None  # type: ignore[attr-defined]
    assert all(p._packed is not None for p in runner.model._projections())  # type: ignore[attr-defined]


def test_a_bf16_runner_makes_every_packed_copy_at_start_where_the_cpu_can() -> None:
    runner = _runner("bfloat16", pack_at_start=True)
    projections = runner.model._projections()  # type: ignore[attr-defined]
    # amx_gemm.c's before the runner is returned, where it serves a projection (AMX-BF16 here)
    assert all((p.amx_gemm is None) == (p._amx_packed is None) for p in projections)
    packed = _packed(runner)
    assert len(packed) == 2 * 4 + 1
    # a CPU without oneDNN's bf16 reorder (AVX2-only) makes none, and its calls run F.linear
    assert packed == [_cpu_can_prepack_bf16()] * len(packed)


def test_without_pack_at_start_the_copies_wait_for_the_first_calls() -> None:
    assert not any(_packed(_runner("bfloat16", pack_at_start=False)))


def test_float32_makes_none_at_start() -> None:
    # there only some row counts take the packed copy: a server that never calls with them never needs it
    assert not any(_packed(_runner("float32", pack_at_start=True)))


_EXIT_WHILE_COPYING = """
import threading
from prelude.model.layers.linear import Projection
from tests.executor.test_pack_at_start import _runner

real = Projection.make_packed_copy
main_done = threading.Event()

def after_main(self):
    main_done.wait(30)  # every copy after the main thread's last line
    made = real(self)
    print("copied", flush=True)
    return made

Projection.make_packed_copy = after_main
# built on a daemon thread, as a server's engine thread builds its model
builder = threading.Thread(target=_runner, args=("bfloat16", True), daemon=True)
builder.start()
builder.join()
print("main done", flush=True)
main_done.set()
"""


def test_a_process_that_exits_while_the_thread_copies_waits_for_it_and_exits_cleanly() -> None:
    """A server stopped right after ready ends while oneDNN's copies are being made: the
    process waits for them, where a daemon thread killed inside a torch op at interpreter
    exit aborted it (SIGABRT, "terminate called without an active exception")."""
    if not _cpu_can_prepack_bf16():
        pytest.skip("this CPU cannot prepack bf16 weights (needs AVX-512): no thread to wait for")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_COPYING], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # the main thread ended first, and the process still made every projection's copy
    assert done.stdout.split() == ["main", "done"] + ["copied"] * (2 * 4 + 1)
    assert "terminate called" not in done.stderr
