"""Collect a step's result tensors and bring them to the host in one copy.

Each `add` returns a handle; `start` concatenates everything (as float32, flattened) and
starts one device-to-host copy (non-blocking into pinned memory on CUDA, so the host can
schedule the next step meanwhile); the handles' `get` waits for it and reads their slices
back as Python lists. Integers (token ids, ranks) are exact in float32 below 2**24, which
every vocabulary here is.
"""

from __future__ import annotations

import torch


class HostValue:
    """A result tensor's values on the host, available once the copy has landed."""

    def __init__(self, owner: "HostCopy", offset: int, shape: tuple[int, ...]) -> None:
        self._owner, self._offset, self._shape = owner, offset, shape

    def get(self) -> list:  # type: ignore[type-arg]
        n = 1
        for d in self._shape:
            n *= d
        flat = self._owner.values()[self._offset : self._offset + n]
        if len(self._shape) == 0:
            return flat[0]
        if len(self._shape) == 1:
            return flat
        width = n // self._shape[0] if self._shape[0] else 0
        return [flat[i * width : (i + 1) * width] for i in range(self._shape[0])]


class HostCopy:
    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._size = 0
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._values: list[float] | None = None

    def add(self, tensor: torch.Tensor) -> HostValue:
        assert self._host is None, "the copy has started"
        value = HostValue(self, self._size, tuple(tensor.shape))
        self._parts.append(tensor.reshape(-1).to(torch.float32))
        self._size += tensor.numel()
        return value

    def start(self) -> None:
        """Start the one device-to-host copy (returns at once on CUDA)."""
        if not self._parts:
            self._values = []
            return
        flat = torch.cat(self._parts)
        self._parts = []
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def values(self) -> list[float]:
        if self._values is None:
            if self._host is None:
                self.start()
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist() if self._host is not None else []
        return self._values
