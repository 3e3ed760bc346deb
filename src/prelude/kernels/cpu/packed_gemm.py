"""A GEMM of our own over a packed copy of the weight, called through ctypes: what
amx_gemm.py (bf16) and f32_gemm.py (float32) share. The library exports
`<prefix>_pack(w, n, k, wp, threads)` and `<prefix>(x, m, ldx, wp, n, k, bias, y, ldy,
threads)`, both returning 0, or 1 on arguments they do not take."""

from __future__ import annotations

import ctypes

import torch

from prelude.kernels.cpu import native_lib


class PackedGemm:
    """The loaded library. Subclasses say what their calls take: `dtype` (x, W, bias and y),
    the packed copy's element type and alignment, and `what` (error messages)."""

    dtype: torch.dtype
    packed_dtype: torch.dtype  # the copy's elements: several weight values a word, or one
    align: int  # the copy's start, in bytes
    what: str

    def __init__(self, lib: ctypes.CDLL, prefix: str) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._pack = getattr(lib, f"{prefix}_pack")
        self._pack.restype = ctypes.c_int
        self._pack.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
        self._fn = getattr(lib, prefix)
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]

    @property
    def entry_point(self) -> int:
        """The address of the GEMM (layer_loop.c may call it)."""
        return native_lib.address(self._fn)

    @property
    def _per_word(self) -> int:
        return self.packed_dtype.itemsize // self.dtype.itemsize

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether calls through `weight` [out, k] can run here (each subclass says)."""
        raise NotImplementedError

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The copy of `weight` [out, k] the kernel reads, `align`-byte aligned."""
        if not self.takes(weight):
            raise ValueError(f"{self.what} cannot pack {weight.dtype} {tuple(weight.shape)}")
        w = weight.contiguous()
        words = w.numel() // self._per_word
        slack = self.align // self.packed_dtype.itemsize  # torch aligns to 64, but need not
        store = torch.empty(words + slack, dtype=self.packed_dtype)
        skip = (-store.data_ptr() % self.align) // self.packed_dtype.itemsize
        packed = store[skip:skip + words]
        if self._pack(w.data_ptr(), w.shape[0], w.shape[1], packed.data_ptr(), torch.get_num_threads()) != 0:
            raise RuntimeError(f"{self.what}'s packing refused {tuple(w.shape)}")
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, k] in `dtype` (unit stride along k) -> [rows, out_features]: x W^T (+ bias),
        float32 sums rounded once to `dtype`; `packed` from pack(W)."""
        if x.dim() != 2 or x.dtype != self.dtype or x.stride(1) != 1 or x.shape[0] < 1:
            raise ValueError(f"{self.what} takes [rows, k] {self.dtype} rows, got {x.dtype} {tuple(x.shape)}")
        m, k = x.shape
        if packed.numel() * self._per_word != out_features * k:
            raise ValueError(f"a packed weight of {packed.numel() * self._per_word} for {out_features} x {k}")
        if bias is not None:
            bias = bias.contiguous()
            if bias.dtype != self.dtype or bias.numel() != out_features:
                raise ValueError(f"a bias of {bias.dtype} x {bias.numel()} for {out_features} {self.dtype} outputs")
        y = torch.empty(m, out_features, dtype=self.dtype)
        rc = self._fn(x.data_ptr(), m, x.stride(0), packed.data_ptr(), out_features, k,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"{self.what} refused its arguments ({m} rows, {out_features}x{k})")
        return y
