"""Attention backends, chosen by name through a registry (never `if cuda:` in model code)."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from prelude.model.attention.metadata import AttentionMetadata
from prelude.model.attention.torch_backend import TorchAttention


class AttentionBackend(Protocol):
    name: str
    # Reads `AttentionMetadata.prefill_tensors` (device row tensors) rather than the
    # host-side `prefills` list: only such a backend can run inside a captured prefill graph.
    reads_prefill_tensors: bool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def _triton() -> AttentionBackend:
    # Imported on demand: triton is optional (a test extra), and importing it decides once
    # whether its kernels are compiled or interpreted (TRITON_INTERPRET).
    from prelude.model.attention.triton_backend import TritonAttention

    return TritonAttention()


def _cpu() -> AttentionBackend:
    # The C kernel over the block pool, built on first use; torch SDPA where it cannot be
    # (no compiler or AVX2+FMA, or PRELUDE_CPU_ATTENTION=0: native_lib logs why).
    from prelude.model.attention.cpu_backend import load_cpu_attention

    backend = load_cpu_attention()
    return backend if backend is not None else TorchAttention()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": TorchAttention, "triton": _triton, "cpu": _cpu}


def get_attention_backend(name: str = "torch", device: torch.device | None = None) -> AttentionBackend:
    """`torch` runs everywhere; other backends name the devices they support."""
    try:
        backend = _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}") from None
    supported = getattr(backend, "devices", ("cpu", "cuda"))
    if device is not None and device.type not in supported:
        raise ValueError(f"attention backend {name!r} runs on {', '.join(supported)}, not {device.type}")
    return backend
