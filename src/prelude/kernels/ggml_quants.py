"""Projection weights kept in GGUF's quantized 32-weight blocks (Q4_0, Q4_1, Q8_0).

A GGUF checkpoint is converted once into float32 safetensors (what prefill GEMMs and
every other engine read), and its quantized projections are also kept as they were
stored, repacked into three plain arrays per weight: few-row calls (decode) read those
through kernels/cpu/quant_gemm.py, far fewer bytes than float32. Expanded, a block equals
gguf's own dequantization bit for bit (`dequantize`), so both copies hold the same weights.

Stored beside the converted model as BLOCKS_FILE, with tensor names
`<weight name>.qs|.d|.m` and each weight's kind in the file's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCKS_FILE = "prelude-ggml-blocks.bin"  # safetensors inside; not *.safetensors, so HF/vLLM loaders skip it
BLOCK = 32
KINDS = ("q4_0", "q4_1", "q8_0")  # the kernel's kind numbers are indices into this
# GGUF type name -> (ours, bytes of a stored block: fp16 d [, fp16 m], quants)
_GGUF_TYPES = {"Q4_0": ("q4_0", 18), "Q4_1": ("q4_1", 20), "Q8_0": ("q8_0", 34)}


@dataclass(frozen=True)
class GgmlQuants:
    """One weight [N, K] in blocks of 32 along K: qs uint8 [N, K/2] (4-bit, ggml's nibble
    order) or int8 [N, K] (8-bit), scales d float32 [N, K/32], mins m (q4_1 only)."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return int(self.qs.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.d.shape[1]) * BLOCK

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], computed as gguf's dequantizer does (multiply, then add)."""
        n, nb = self.d.shape
        if self.kind == "q8_0":
            q = self.qs.view(torch.int8).reshape(n, nb, BLOCK).float()
        else:
            raw = self.qs.reshape(n, nb, BLOCK // 2)
            q = torch.cat([raw & 0x0F, raw >> 4], dim=-1).float()
            if self.kind == "q4_0":
                q = q - 8
        w = self.d.unsqueeze(-1) * q
        if self.m is not None:
            w = w + self.m.unsqueeze(-1)
        return w.reshape(n, nb * BLOCK)

    def select_rows(self, index: torch.Tensor) -> GgmlQuants:
        return GgmlQuants(self.kind, self.qs[index].contiguous(), self.d[index].contiguous(),
                          None if self.m is None else self.m[index].contiguous())

    @staticmethod
    def cat(parts: list[GgmlQuants | None]) -> GgmlQuants | None:
        """Rows of several weights stacked (fused q/k/v, gate/up); None unless every part
        has blocks of one kind over the same K."""
        first = parts[0]
        if first is None or any(p is None or p.kind != first.kind or p.in_features != first.in_features
                                for p in parts):
            return None
        ps = [p for p in parts if p is not None]
        return GgmlQuants(first.kind, torch.cat([p.qs for p in ps]), torch.cat([p.d for p in ps]),
                          None if first.m is None else torch.cat([p.m for p in ps if p.m is not None]))

    @staticmethod
    def from_gguf(gguf_type: str, raw: np.ndarray, rows: int) -> GgmlQuants | None:
        """From a GGUF tensor's stored bytes (uint8, `rows` x a row's blocks); None for a
        type this module does not keep."""
        if gguf_type not in _GGUF_TYPES:
            return None
        kind, block_bytes = _GGUF_TYPES[gguf_type]
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, block_bytes)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "q4_1" else None
        qs = blocks[..., 4 if kind == "q4_1" else 2:].reshape(rows, -1)
        return GgmlQuants(kind, torch.from_numpy(qs.copy()), torch.from_numpy(d),
                          None if m is None else torch.from_numpy(m))

    def to_tensors(self, name: str) -> dict[str, torch.Tensor]:
        out = {f"{name}.qs": self.qs, f"{name}.d": self.d}
        if self.m is not None:
            out[f"{name}.m"] = self.m
        return out


def save_blocks(blocks: dict[str, GgmlQuants], path: Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, b in blocks.items():
        tensors |= b.to_tensors(name)
    # no metadata at all when empty: safetensors writes an unreadable header for {} with metadata {}
    save_file(tensors, str(path), metadata={name: b.kind for name, b in blocks.items()} or None)


def load_blocks(path: Path) -> dict[str, GgmlQuants]:
    """The blocks stored beside a converted GGUF ({} when there is no such file)."""
    if not path.is_file():
        return {}
    from safetensors import safe_open

    out: dict[str, GgmlQuants] = {}
    with safe_open(str(path), framework="pt") as f:
        for name, kind in (f.metadata() or {}).items():
            m = f.get_tensor(f"{name}.m") if kind == "q4_1" else None
            out[name] = GgmlQuants(kind, f.get_tensor(f"{name}.qs"), f.get_tensor(f"{name}.d"), m)
    return out
