"""The greedy head: the argmax of a float32 LM head's logits without the logits
(kernels/cpu/head_argmax.py), for the calls whose logits Projection would compute with
row_gemv.c's kernels only, so the token is that path's argmax bit for bit."""

from __future__ import annotations

import torch

from prelude.kernels.cpu.head_argmax import MAX_K, HeadArgmax, load_head_argmax_kernel
from prelude.model.layers.linear import Projection


def serves(head: Projection, x: torch.Tensor) -> bool:
    """Whether `head(x)` runs row_gemv.c's float32 kernels only (Projection.runs_row_gemv),
    whose sums the exact pass repeats, on a head the bound covers (no bias, a width of a
    multiple of 32 up to MAX_K)."""
    w = head.weight
    return (x.dim() == 2 and head.runs_row_gemv(x.shape[0], x.dtype) and head.blocks is None and head.bias is None
            and x.device.type == "cpu" and x.shape[-1] == w.shape[1] and w.shape[1] % 32 == 0 and w.shape[1] <= MAX_K)


def head_argmax_for(head: Projection) -> HeadArgmax | None:
    """The greedy head over `head`'s weight (its copy made now), or None without the
    kernel (no compiler, no AVX512_BF16, PRELUDE_HEAD_ARGMAX=0)."""
    fn = load_head_argmax_kernel()
    return None if fn is None else HeadArgmax(fn, head.weight)
