"""Resolve the configured device, dtype and attention backend against the machine."""

from __future__ import annotations

import importlib.util

import torch

from prelude.kernels.cpu.native_lib import cpu_isa_flags

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

# ISA extensions with a native bfloat16 dot product, the ones oneDNN's bf16 GEMM needs to
# beat float32. Without them, bf16 GEMMs are converted/emulated and lose by a wide margin.
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool((cpu_isa_flags() if flags is None else flags) & _NATIVE_BF16_FLAGS)


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when a device is present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use auto, cpu or cuda")
    return device


def auto_dtype(device: torch.device, flags: frozenset[str] | None = None) -> torch.dtype:
    """bfloat16 on a GPU (the tensor-core type) and on a CPU with a native bf16 dot product
    (AVX512-BF16 or AMX: oneDNN's prepacked bf16 GEMM, several times float32's rate there).
    float32 on any other CPU: without a native bf16 dot product, bf16 forwards are several
    times slower than float32 for prefills and slower for decode steps (docs/design.md)."""
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16(flags) else torch.float32


def dtype_reason(name: str, device: torch.device, flags: frozenset[str] | None = None) -> str:
    """Why `resolve_dtype(name, device)` picks what it picks (one phrase, for the start-up log)."""
    if name != "auto":
        return "asked for"
    if device.type != "cpu":
        return "auto: the GPU's tensor-core type"
    native = sorted((cpu_isa_flags() if flags is None else flags) & _NATIVE_BF16_FLAGS)
    if native:
        return f"auto: this CPU has {', '.join(native)}, native bf16 dot products"
    return "auto: this CPU has no AVX512-BF16 or AMX, where bf16 GEMMs are emulated and lose to float32"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` picks by device and CPU capability (see `auto_dtype`); tests compare float32 exactly."""
    if name == "auto":
        return auto_dtype(device)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, float32, bfloat16 or float16")
    if _DTYPES[name] is torch.float16 and device.type == "cpu":
        raise ValueError("float16 is not supported on the CPU; use bfloat16 or float32")
    return _DTYPES[name]


def resolve_attention_backend(name: str, device: torch.device, has_triton: bool | None = None) -> str:
    """`auto` is this project's Triton kernels on CUDA (prefill graphs need them) when triton
    is installed, else torch SDPA; on the CPU the C paged-attention kernel ("cpu", which
    itself falls back to torch SDPA where it cannot be built)."""
    if name != "auto":
        return name
    if device.type == "cpu":
        return "cpu"
    if has_triton is None:
        has_triton = importlib.util.find_spec("triton") is not None
    return "triton" if device.type == "cuda" and has_triton else "torch"
