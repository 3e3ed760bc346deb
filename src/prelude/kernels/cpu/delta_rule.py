"""Gated DeltaNet's sequence work on the CPU through a small C kernel (delta_rule.c):

- `delta_rule`: the gated delta rule over every row of a step in one call (prompt rows of
  any length, packed items, one-token decode rows), each row's float32 state updated in
  its place (a slot of the pool, or the step's scratch);
- `conv`: the causal depthwise conv + SiLU in front of it, with its state, over the same rows;
- `gated_rms_norm`: the RMSNorm gated by SiLU(z) after it (the eager ops' roundings).

Rows are int64 [n, 4] (start, length, dst, src), states named by place: p >= 0 is slot p of
the pool, p <= -2 entry -2 - p of the scratch, src -1 a zero state (delta_rule.c says
more). Taps, int64 [m, 2] (token, place) sorted by token, copy a row's state after that
token into a place as well: the state at a position inside a prompt.

Built on first use like the other C kernels (kernels/cpu/native_lib.py);
PRELUDE_DELTA_RULE=0 turns it off (the layer then runs transformers-equivalent torch).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("delta_rule.c")
DTYPES = (torch.float32, torch.bfloat16)  # the C side's `bf` flag: index in this tuple
MAX_KEY_DIM = 256  # the C side's per-unit state block
MAX_CONV_WIDTH = 8


def _heads(x: torch.Tensor, name: str) -> int:
    """x [T, H, d] with contiguous heads; its token stride."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"{name} must be [tokens, heads, dim] with contiguous heads, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x.stride(0)


def _table(x: torch.Tensor | None, name: str) -> tuple[int | None, int]:
    """An int64 [n, 2|4] table's pointer and rows (None, 0 for none)."""
    if x is None or x.numel() == 0:
        return None, 0
    if x.dtype != torch.int64 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous int64 CPU table")
    return x.data_ptr(), x.shape[0]


def _states(x: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> tuple[int | None, int]:
    """A state array's pointer and entries (None, 0 for none)."""
    if x is None or x.shape[0] == 0:
        return None, 0
    if x.dtype != dtype or not x.is_contiguous() or tuple(x.shape[1:]) != shape:
        raise ValueError(f"{name} must be contiguous {dtype} [n, {', '.join(map(str, shape))}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    return x.data_ptr(), x.shape[0]


class DeltaRuleKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
        self._rule = lib.prelude_gated_delta_rule
        self._rule.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, i64, ptr, i64,
                               ptr, i64, ptr, i64, ptr, c_int, c_int]
        self._conv = lib.prelude_causal_conv
        self._conv.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, c_int, c_int]
        self._norm = lib.prelude_gated_rms_norm
        self._norm.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, f32, ptr, c_int, c_int]
        for fn in (self._rule, self._conv, self._norm):
            fn.restype = c_int

    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   rows: torch.Tensor, pool: torch.Tensor | None, scratch: torch.Tensor | None, scale: float,
                   taps: torch.Tensor | None = None) -> torch.Tensor:
        """q, k [T, Hk, dk], v [T, Hv, dv] (float32 or bf16, heads contiguous, any token
        stride); g (log decay) and beta float32 [T, Hv]; states float32 [n, Hv, dk, dv].
        q/k are L2-normed here and q scaled by `scale`. Returns the output [T, Hv, dv] in v's dtype."""
        tokens, hk, dk = q.shape
        hv, dv = v.shape[1:]
        dtype = v.dtype
        if dtype not in DTYPES or q.dtype != dtype or k.dtype != dtype or k.shape != q.shape or v.shape[0] != tokens:
            raise ValueError(f"q/k/v: one dtype of {DTYPES} and matching shapes, got {q.dtype} {tuple(q.shape)}, "
                             f"{k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}")
        if dk > MAX_KEY_DIM or hv % hk:
            raise ValueError(f"key dim {dk} (at most {MAX_KEY_DIM}), {hv} value heads over {hk} key heads")
        for t, name in ((g, "g"), (beta, "beta")):
            if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != (tokens, hv):
                raise ValueError(f"{name} must be contiguous float32 [{tokens}, {hv}]")
        rows_ptr, n_rows = _table(rows, "rows")
        taps_ptr, n_taps = _table(taps, "taps")
        pool_ptr, n_pool = _states(pool, torch.float32, (hv, dk, dv), "the state pool")
        scratch_ptr, n_scratch = _states(scratch, torch.float32, (hv, dk, dv), "the scratch states")
        out = torch.empty(tokens, hv, dv, dtype=dtype)
        rc = self._rule(q.data_ptr(), _heads(q, "q"), k.data_ptr(), _heads(k, "k"), v.data_ptr(), _heads(v, "v"),
                        g.data_ptr(), beta.data_ptr(), tokens, hk, hv, dk, dv, scale, rows_ptr, n_rows, pool_ptr,
                        n_pool, scratch_ptr, n_scratch, taps_ptr, n_taps, out.data_ptr(), DTYPES.index(dtype),
                        torch.get_num_threads())
        if rc != 0:
            raise ValueError("delta_rule.c refused the rows, taps or dims (a place outside the states, a row "
                             "outside the tokens, taps out of order)")
        return out

    def conv(self, x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, pool: torch.Tensor | None,
             scratch: torch.Tensor | None, taps: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, C] (unit column stride), weight [C, K], states [n, C, K - 1] in x's dtype.
        Returns SiLU(conv) [T, C], contiguous, in x's dtype."""
        tokens, channels = x.shape
        dtype = x.dtype
        width = weight.shape[1]
        if dtype not in DTYPES or weight.dtype != dtype or x.stride(1) != 1 or weight.shape[0] != channels:
            raise ValueError(f"x [T, C] with unit column stride and weight [C, K] of one dtype of {DTYPES}")
        if not 2 <= width <= MAX_CONV_WIDTH:
            raise ValueError(f"conv width {width}: 2 to {MAX_CONV_WIDTH}")
        w = weight.contiguous()
        rows_ptr, n_rows = _table(rows, "rows")
        taps_ptr, n_taps = _table(taps, "taps")
        pool_ptr, n_pool = _states(pool, dtype, (channels, width - 1), "the conv state pool")
        scratch_ptr, n_scratch = _states(scratch, dtype, (channels, width - 1), "the conv scratch states")
        out = torch.empty(tokens, channels, dtype=dtype)
        rc = self._conv(x.data_ptr(), x.stride(0), tokens, w.data_ptr(), channels, width, rows_ptr, n_rows, pool_ptr,
                        n_pool, scratch_ptr, n_scratch, taps_ptr, n_taps, out.data_ptr(), DTYPES.index(dtype),
                        torch.get_num_threads())
        if rc != 0:
            raise ValueError("delta_rule.c refused the conv's rows or taps (a place outside the states, a row "
                             "outside the tokens, taps out of order)")
        return out

    def gated_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [T, H, d] over d times SiLU(gate) (gate [T, H, d], heads contiguous, any
        token stride), the eager `gated_rms_norm`'s roundings: [T, H * d] in x's dtype."""
        tokens, heads, d = x.shape
        dtype = x.dtype
        if dtype not in DTYPES or gate.dtype != dtype or weight.dtype != dtype or not x.is_contiguous() \
                or weight.numel() != d or gate.shape != x.shape:
            raise ValueError("gated_rms_norm: x [T, H, d] contiguous, gate [T, H, d] and weight [d] of one dtype")
        w = weight.contiguous()
        out = torch.empty(tokens, heads * d, dtype=dtype)
        rc = self._norm(x.data_ptr(), gate.data_ptr(), _heads(gate, "gate"), w.data_ptr(), tokens, heads, d, eps,
                        out.data_ptr(), DTYPES.index(dtype), torch.get_num_threads())
        if rc != 0:
            raise ValueError("delta_rule.c refused the gated norm's dims")
        return out


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


SWITCH = "PRELUDE_DELTA_RULE"


def load_delta_rule() -> DeltaRuleKernels | None:
    """The kernels, built on first use on this machine; None where they cannot run, or
    while PRELUDE_DELTA_RULE is "0" (read at each call: a benchmark alternates the two)."""
    return None if os.environ.get(SWITCH, "1") == "0" else _load()


@functools.cache
def _load() -> DeltaRuleKernels | None:
    lib = native_lib.load(_SOURCE, SWITCH, "the C delta rule (Gated DeltaNet runs in torch)")
    return None if lib is None else DeltaRuleKernels(lib)
