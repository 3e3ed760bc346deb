"""Resolve the configured device and dtype against the machine."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on every device: on this CPU class it is ~3x faster than
    float32 (DESIGN.md §5), on a GPU it is the native tensor-core type; tests compare
    float32 exactly."""
    if name == "auto":
        return torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, float32, bfloat16 or float16")
    if _DTYPES[name] is torch.float16 and device.type == "cpu":
        raise ValueError("float16 is not supported on the CPU; use bfloat16 or float32")
    return _DTYPES[name]
