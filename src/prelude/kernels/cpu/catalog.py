"""The one list of the CPU's C kernels: what `make install` builds ahead, what a CPU start
builds on threads while the checkpoint loads, and what the tests build. Each entry is a
module of this folder whose `build()` compiles its C file of the same name into the cache."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

KERNELS = (
    "amx_gemm",
    "bf16_rows",
    "cpu_attention",
    "cpu_fused",
    "delta_rule",
    "f32_gemm",
    "head_argmax",
    "layer_loop",
    "lora_cpu",
    "moe_experts",
    "quant_gemm",
    "row_argmax",
    "row_gemv",
)


def builder(name: str) -> Callable[[], Path]:
    """The `build` of the kernel `name` (one of KERNELS)."""
    if name not in KERNELS:
        raise KeyError(f"no CPU kernel {name!r}; kernels: {', '.join(KERNELS)}")
    return importlib.import_module(f"prelude.kernels.cpu.{name}").build


def build_all() -> list[str]:
    """Build every kernel this machine can build; the names of those that failed (a kernel
    whose ISA this CPU lacks, or no compiler: its loader reports it when it is asked for)."""
    failed = []
    for name in KERNELS:
        try:
            builder(name)()
        except Exception:  # noqa: BLE001 - reported by the kernel's loader at its first use
            failed.append(name)
    return failed


if __name__ == "__main__":
    missing = build_all()
    if missing:
        print(f"not built here: {', '.join(missing)}", file=sys.stderr)
