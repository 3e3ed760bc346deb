"""KV pool sizing (executor/kv_sizing.py) with injected device numbers: CUDA takes what
--gpu-memory-utilization leaves after what is in use, the peak activations and the graphs;
the CPU and an explicit --kv-cache-memory-gib keep a fixed budget."""

from __future__ import annotations

import argparse

import pytest

from prelude.executor.kv_sizing import GIB, DeviceMemory, kv_cache_budget, split_window_pool, window_blocks_wanted


def _h100(in_use_gib: float, peak_gib: float = 2.0, graphs_gib: float = 0.5) -> DeviceMemory:
    total = 80 * GIB
    return DeviceMemory(total, total - int(in_use_gib * GIB), int(peak_gib * GIB), int(graphs_gib * GIB))


def test_cuda_takes_what_utilization_leaves_after_weights_activations_and_graphs() -> None:
    budget = kv_cache_budget(_h100(in_use_gib=16.0), kv_cache_memory_gib=None, gpu_memory_utilization=0.9)
    assert budget.bytes == int(80 * GIB * 0.9) - 16 * GIB - 2 * GIB - GIB // 2  # 53.5 GiB, not 1 GiB
    assert "--gpu-memory-utilization" in budget.reason and "16.00 GiB in use" in budget.reason


def test_cuda_utilization_scales_the_pool() -> None:
    half = kv_cache_budget(_h100(in_use_gib=16.0), kv_cache_memory_gib=None, gpu_memory_utilization=0.5)
    assert half.bytes == 40 * GIB - 16 * GIB - 2 * GIB - GIB // 2


def test_lora_slots_on_cuda_are_already_in_use_and_not_taken_twice() -> None:
    plain = kv_cache_budget(_h100(16.0), kv_cache_memory_gib=None, gpu_memory_utilization=0.9)
    with_slots = kv_cache_budget(_h100(16.0), kv_cache_memory_gib=None, gpu_memory_utilization=0.9,
                                 resident_bytes=GIB)
    assert with_slots.bytes == plain.bytes


def test_a_full_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no device memory is left for the KV cache.*--gpu-memory-utilization"):
        kv_cache_budget(_h100(in_use_gib=75.0), kv_cache_memory_gib=None, gpu_memory_utilization=0.9)


def test_cpu_keeps_its_default_budget_and_says_so() -> None:
    budget = kv_cache_budget(None, kv_cache_memory_gib=None, gpu_memory_utilization=0.9)
    assert budget.bytes == GIB and "CPU default" in budget.reason


def test_an_explicit_budget_wins_on_any_device_less_lora_slots() -> None:
    for memory in (None, _h100(16.0)):
        budget = kv_cache_budget(memory, kv_cache_memory_gib=2.0, gpu_memory_utilization=0.9,
                                 resident_bytes=GIB // 4)
        assert budget.bytes == 2 * GIB - GIB // 4
        assert "--kv-cache-memory-gib" in budget.reason and "LoRA" in budget.reason


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_utilization_outside_0_1_is_refused(utilization: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_budget(_h100(16.0), kv_cache_memory_gib=None, gpu_memory_utilization=utilization)


def test_cli_defaults_size_from_the_device() -> None:
    from prelude.cli import _add_engine_args, _engine_config

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    cache = _engine_config(p.parse_args(["--model", "x"])).cache
    assert cache.kv_cache_memory_gib is None and cache.gpu_memory_utilization == 0.9
    cache = _engine_config(p.parse_args(["--model", "x", "--kv-cache-memory-gib", "3",
                                         "--gpu-memory-utilization", "0.8"])).cache
    assert cache.kv_cache_memory_gib == 3.0 and cache.gpu_memory_utilization == 0.8


def test_a_server_fills_its_pool_beside_start_up_and_a_batch_job_before_its_first_line() -> None:
    """`prelude serve` faults the CPU pool's pages in from a thread (ready sooner); run-batch
    before its first line, so the RSS a job's lines add is measured from a full pool."""
    from prelude.cli import _add_engine_args, _engine_config

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    args = p.parse_args(["--model", "x"])
    assert _engine_config(argparse.Namespace(**vars(args), command="serve")).cache.populate_kv == "background"
    assert _engine_config(argparse.Namespace(**vars(args), command="run-batch")).cache.populate_kv == "start"


def test_a_window_pool_takes_what_the_windows_need_and_the_global_layers_the_rest() -> None:
    # Gemma-3-1B's shape in bf16, blocks of 16: 4 global layers (64 KiB a block), 22 sliding (352 KiB)
    per_block, window_per_block = 26 * 16 * 1024, 22 * 16 * 1024
    wanted = window_blocks_wanted(512, 16, max_num_seqs=64, step_tokens=2048)
    assert wanted == 64 * 34 + 128  # 33 blocks a window, one more at an edge, and a step's chunk
    glob, window = split_window_pool(GIB, per_block, window_per_block, wanted)
    assert window == wanted
    assert glob * (per_block - window_per_block) + window * window_per_block <= GIB
    assert glob > GIB // per_block  # more context for the global layers than one shared pool gives
    # a budget too small for every window: the window pool never takes more than a shared pool's
    # blocks, so the global layers never get fewer than they would have
    glob, window = split_window_pool(GIB // 8, per_block, window_per_block, wanted)
    assert window == GIB // 8 // per_block and glob == GIB // 8 // per_block + (GIB // 8 % per_block) // (
        per_block - window_per_block)
