"""How much memory the paged KV cache gets, and why.

On CUDA the pool takes what is left of `gpu_memory_utilization` of the device after
everything else: the weights (and LoRA slots, the CUDA context, other processes: all that
is in use when the engine sizes the pool), the peak activations of the largest step
(measured by one throwaway forward), and a reserve for the CUDA graphs captured after
the pool exists. vLLM's `--gpu-memory-utilization` (0.9) means the same. An explicit
`--kv-cache-memory-gib` overrides this.

On the CPU the host's memory is everyone's, so the pool keeps a fixed budget
(`--kv-cache-memory-gib`, default 1 GiB), from which resident LoRA slots are taken.

`kv_cache_budget` is a pure function of the numbers it is given: the runner measures the
device (`ModelRunner.device_memory`), the engine logs the chosen budget with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
CPU_DEFAULT_GIB = 1.0
# CUDA graphs capture after the pool is allocated, so their memory can only be estimated
# here: the captured buckets share one memory pool, whose size is of the order of a large
# decode step's activations.
GRAPH_RESERVE_BYTES = 512 * 2**20


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory at the moment the KV pool is sized (weights loaded)."""

    total_bytes: int
    free_bytes: int  # what the driver reports free now
    peak_activation_bytes: int  # the largest step's temporaries, measured
    graph_reserve_bytes: int  # estimated for the CUDA graphs (0 when none will be captured)


@dataclass(frozen=True)
class KVBudget:
    bytes: int
    reason: str  # logged: where the number came from


def window_blocks_wanted(window: int, block_size: int, max_num_seqs: int, step_tokens: int) -> int:
    """Window-pool blocks that `max_num_seqs` running requests' windows (window / block + 1
    each, one more at a block edge) and a step's new tokens (a prompt chunk's blocks before
    its window slides) take."""
    per_request = (window - 1 + block_size - 1) // block_size + 1
    return max_num_seqs * (per_request + 1) + (step_tokens + block_size - 1) // block_size


def split_window_pool(budget_bytes: int, bytes_per_block: int, window_bytes_per_block: int,
                      wanted: int) -> tuple[int, int]:
    """(global blocks, window blocks) for a model whose sliding layers (`window_bytes_per_block`
    of `bytes_per_block`, every layer's) keep a pool of their own: the window pool gets what
    it wants, but never more than the blocks every layer would share without it, so the
    global layers never get fewer blocks than they would; they take the rest."""
    shared = max(1, budget_bytes // max(1, bytes_per_block))
    window = max(1, min(wanted, shared))
    per_global = max(1, bytes_per_block - window_bytes_per_block)
    return max(1, (budget_bytes - window * window_bytes_per_block) // per_global), window


def kv_cache_budget(
    memory: DeviceMemory | None,
    *,
    kv_cache_memory_gib: float | None,
    gpu_memory_utilization: float,
    resident_bytes: int = 0,
) -> KVBudget:
    """The KV pool's size in bytes. `memory`: the CUDA device's numbers, None on the CPU.
    `kv_cache_memory_gib`: an explicit budget (None: sized as described above).
    `resident_bytes`: what else lives in an explicit or CPU budget (LoRA slots); on CUDA
    it is already counted as in use."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {gpu_memory_utilization}")
    if kv_cache_memory_gib is not None or memory is None:
        gib = CPU_DEFAULT_GIB if kv_cache_memory_gib is None else kv_cache_memory_gib
        source = "--kv-cache-memory-gib" if kv_cache_memory_gib is not None else \
            f"the CPU default budget ({CPU_DEFAULT_GIB:g} GiB; --kv-cache-memory-gib sets it)"
        budget = int(gib * GIB) - resident_bytes
        lora = f" less {resident_bytes / GIB:.2f} GiB of LoRA slots" if resident_bytes else ""
        return KVBudget(max(0, budget), f"{gib:g} GiB from {source}{lora}")
    in_use = memory.total_bytes - memory.free_bytes
    usable = int(memory.total_bytes * gpu_memory_utilization)
    budget = usable - in_use - memory.peak_activation_bytes - memory.graph_reserve_bytes
    reason = (f"{gpu_memory_utilization:g} x {memory.total_bytes / GIB:.2f} GiB (--gpu-memory-utilization) "
              f"less {in_use / GIB:.2f} GiB in use (weights, context, other processes), "
              f"{memory.peak_activation_bytes / GIB:.2f} GiB peak activations and "
              f"{memory.graph_reserve_bytes / GIB:.2f} GiB for CUDA graphs")
    if budget <= 0:
        raise ValueError(f"no device memory is left for the KV cache: {reason}; raise "
                         "--gpu-memory-utilization, lower --max-num-batched-tokens, or free the device")
    return KVBudget(budget, reason)
