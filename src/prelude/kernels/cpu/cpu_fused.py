"""The decoder's elementwise work between GEMMs, fused for float32 and bfloat16 on the CPU
(cpu_fused.c: float32 math inside, bf16 rounded where the eager bf16 ops round).

The same four operations, signatures and numerics as the Triton kernels of
kernels/triton/fused.py (CUDA), so model/layers/fused_segments.py builds one set of
segments over either:

- `add_rms_norm`: the residual add and the next RMSNorm in one pass;
- `rms_norm`: the same without a residual;
- `qk_norm_rope`: split q/k/v out of the fused projection, optional per-head q/k RMSNorm
  (Qwen3), rotary; contiguous q, k, v;
- `silu_mul`: SiLU(gate) * up.

Eagerly these are about 25 torch ops per layer, each a pass over its operands plus its
dispatch cost, and in a bf16 prefill they take a sizeable share of the forward; here they
are four ctypes calls. The residual add and the rotary are bit-identical to the eager ops,
RMSNorm differs by the order of its sum, SiLU by its exp (~1 ulp; in bf16 that can move a
value by one bf16 ulp).
Built on first use like the GGUF-block GEMM (kernels/cpu/native_lib.py); `load_cpu_kernels()` is None
without a compiler or AVX2+FMA, or with PRELUDE_CPU_FUSED=0.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("cpu_fused.c")
MAX_HEAD_DIM = 1024  # the C side's per-head scratch


DTYPES = (torch.float32, torch.bfloat16)  # the C side's `bf` flag: index in this tuple


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D float32 or bf16 rows whose last dimension is contiguous (a view where possible)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"the CPU fused kernels take float32 or bfloat16, got {x.dtype}")
    x = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x if x.stride(-1) == 1 else x.contiguous()


def _same(dtype: torch.dtype, *others: torch.Tensor | None) -> None:
    """Weights and tables in the activations' dtype (the C side reads one dtype per call)."""
    for t in others:
        if t is not None and t.dtype != dtype:
            raise ValueError(f"the CPU fused kernels take one dtype per call: {t.dtype} beside {dtype}")


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


class CpuFusedKernels:
    """The loaded library, with the kernels/triton/fused.py signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
        self._norm = lib.prelude_add_rms_norm
        self._norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, c_int, c_int]
        self._rope = lib.prelude_qk_norm_rope
        self._rope.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, f32, ptr, ptr, ptr, c_int, c_int]
        self._silu = lib.prelude_silu_mul
        self._silu.argtypes = [ptr, i64, ptr, i64, i64, c_int, c_int]
        for fn in (self._norm, self._rope, self._silu):
            fn.restype = c_int

    def entry_points(self) -> tuple[int, int, int]:
        """The addresses of add_rms_norm, qk_norm_rope and silu_mul (layer_loop.c calls them)."""
        return native_lib.address(self._norm), native_lib.address(self._rope), native_lib.address(self._silu)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"cpu_fused.c refused the arguments of {what}")

    def _norm_call(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _rows(x)
        t, n = rows.shape
        dtype = rows.dtype
        _same(dtype, residual, weight)
        out = torch.empty(t, n, dtype=dtype)
        h = torch.empty(t, n, dtype=dtype) if residual is not None else x
        r = _rows(residual) if residual is not None else None
        w = weight.contiguous()
        self._check(self._norm(rows.data_ptr(), rows.stride(0), _ptr(r), 0 if r is None else r.stride(0),
                               w.data_ptr(), h.data_ptr() if residual is not None else None, out.data_ptr(),
                               t, n, eps, torch.get_num_threads(), DTYPES.index(dtype)), "add_rms_norm")
        if x.dim() == 2:  # the segments' case; a view costs a sizeable share of a one-row call
            return h, out
        return h.view(x.shape), out.view(x.shape)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [T, N] (the eager `rms_norm`'s numerics)."""
        return self._norm_call(x, None, weight, eps)[1]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) with h = x + residual, both [T, N]."""
        return self._norm_call(x, residual, weight, eps)

    def qk_norm_rope(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
        sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2 Hkv) * D] -> rotated q [T, Hq, D], k [T, Hkv, D] and v [T, Hkv, D]
        (contiguous); cos/sin [T, 1, D] or [T, D]; q/k norms both or neither."""
        if head_dim % 2 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim}: must be even and at most {MAX_HEAD_DIM}")
        rows = _rows(qkv)
        t, dtype = rows.shape[0], rows.dtype
        if rows.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv of width {rows.shape[1]} for {num_heads}+2x{num_kv_heads} heads of {head_dim}")
        _same(dtype, cos, sin, q_norm, k_norm)
        q = torch.empty(t, num_heads, head_dim, dtype=dtype)
        k = torch.empty(t, num_kv_heads, head_dim, dtype=dtype)
        v = torch.empty(t, num_kv_heads, head_dim, dtype=dtype)
        if cos.numel() != t * head_dim or sin.numel() != t * head_dim:
            raise ValueError(f"cos/sin of {cos.numel()}/{sin.numel()} values for {t} tokens of head_dim {head_dim}")
        # [T, 1, D] as gathered: already the [T, D] rows the C side reads (no reshape: each costs a dispatch)
        cos2d = cos if cos.is_contiguous() else cos.contiguous()
        sin2d = sin if sin.is_contiguous() else sin.contiguous()
        qn = None if q_norm is None else q_norm.contiguous()
        kn = None if k_norm is None else k_norm.contiguous()
        self._check(self._rope(rows.data_ptr(), rows.stride(0), t, num_heads, num_kv_heads, head_dim,
                               cos2d.data_ptr(), sin2d.data_ptr(), _ptr(qn), _ptr(kn), eps, q.data_ptr(),
                               k.data_ptr(), v.data_ptr(), torch.get_num_threads(), DTYPES.index(dtype)),
                    "qk_norm_rope")
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate then up) -> SiLU(gate) * up [T, I]."""
        rows = _rows(gate_up)
        t, n = rows.shape[0], rows.shape[1] // 2
        out = torch.empty(t, n, dtype=rows.dtype)
        self._check(self._silu(rows.data_ptr(), rows.stride(0), out.data_ptr(), t, n, torch.get_num_threads(),
                               DTYPES.index(rows.dtype)), "silu_mul")
        return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], n)


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


def load_cpu_kernels() -> CpuFusedKernels | None:
    """The kernels, built on first use on this machine; None where they cannot run."""
    lib = native_lib.load(_SOURCE, "PRELUDE_CPU_FUSED", "fused CPU kernels (elementwise ops run unfused)")
    return None if lib is None else CpuFusedKernels(lib)
