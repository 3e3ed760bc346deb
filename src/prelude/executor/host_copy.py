"""Collect a step's result tensors and bring them to the host in one copy.

Each `add` returns a handle; `fetch` concatenates everything (as float32, flattened),
copies once, and the handles read their slices back as Python lists. Integers (token ids,
ranks) are exact in float32 below 2**24, which every vocabulary here is.
"""

from __future__ import annotations

import torch


class HostValue:
    """A result tensor's values on the host, available after `HostCopy.fetch`."""

    def __init__(self, owner: "HostCopy", offset: int, shape: tuple[int, ...]) -> None:
        self._owner, self._offset, self._shape = owner, offset, shape

    def get(self) -> list:  # type: ignore[type-arg]
        n = 1
        for d in self._shape:
            n *= d
        flat = self._owner.values[self._offset : self._offset + n]
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
        self.values: list[float] = []

    def add(self, tensor: torch.Tensor) -> HostValue:
        value = HostValue(self, self._size, tuple(tensor.shape))
        self._parts.append(tensor.reshape(-1).to(torch.float32))
        self._size += tensor.numel()
        return value

    def fetch(self) -> None:
        if self._parts:
            self.values = torch.cat(self._parts).cpu().tolist()
