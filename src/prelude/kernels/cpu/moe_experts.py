"""A mixture of experts' chosen experts in one C call (moe_experts.c, OpenMP), built once per
machine (kernels/cpu/native_lib.py) and called through ctypes: the rows grouped by expert,
one pass over each chosen expert's packed weights (gate/up with SiLU(gate) * up, then
down), each row's outputs summed in ascending expert order with the router's weights.

`pack(gate_up, down)` makes the copy the kernel reads (the experts' bytes again, in blocks
of 16 outputs, widths padded to whole blocks), `forward(x, weights, experts, packed)` runs
a step. A row's answer does not depend on the other rows of the call or the thread count.
`load_moe_experts()` is None without a compiler or AVX-512F, or with PRELUDE_MOE_EXPERTS=0;
`takes(dtype)` says whether this build serves a dtype (bf16 needs AVX512-BF16).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("moe_experts.c")
DTYPES = (torch.float32, torch.bfloat16)  # the C side's `bf` flag: index in this tuple
ALIGN = 64  # the packed copies' start, in bytes


@dataclass(frozen=True)
class PackedExperts:
    """The experts as moe_experts.c reads them: `gate_up` and `down` packed, each expert's
    share `gate_up_numel` / `down_numel` elements in a row."""

    gate_up: torch.Tensor
    down: torch.Tensor
    dtype: torch.dtype
    num_experts: int
    hidden: int
    intermediate: int

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()


def _aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D tensor whose data starts on an ALIGN-byte boundary."""
    slack = ALIGN // dtype.itemsize
    store = torch.empty(numel + slack, dtype=dtype)
    skip = (-store.data_ptr() % ALIGN) // dtype.itemsize
    return store[skip:skip + numel]


class MoeExperts:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._forms = native_lib.answer(lib, "prelude_moe_experts_forms")
        self._gu_numel = lib.prelude_moe_packed_gate_up
        self._dn_numel = lib.prelude_moe_packed_down
        for fn in (self._gu_numel, self._dn_numel):
            fn.restype = i64
            fn.argtypes = [c_int, i64, i64]
        self._pack = lib.prelude_moe_pack
        self._pack.restype = c_int
        self._pack.argtypes = [c_int, ptr, ptr, i64, i64, i64, ptr, ptr, c_int]
        self._fn = lib.prelude_moe_experts
        self._fn.restype = c_int
        self._fn.argtypes = [c_int, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64, c_int]

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether this build runs experts in `dtype` (float32: AVX-512F; bf16: AVX512-BF16)."""
        return dtype in DTYPES and bool(self._forms >> DTYPES.index(dtype) & 1)

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> PackedExperts:
        """gate_up [E, 2I, H] (each expert's gate rows, then its up rows), down [E, H, I] ->
        the packed copy (float32 in float32, k pairs as int32 words in bf16)."""
        e, two_i, h = gate_up.shape
        inter = two_i // 2
        if (down.shape != (e, h, inter) or two_i % 2 or gate_up.dtype != down.dtype or not self.takes(gate_up.dtype)
                or gate_up.device.type != "cpu"):
            raise ValueError(f"the MoE kernel cannot pack {gate_up.dtype} {tuple(gate_up.shape)} / "
                             f"{down.dtype} {tuple(down.shape)}")
        bf = DTYPES.index(gate_up.dtype)
        word = torch.int32 if bf else torch.float32
        gu = _aligned(e * self._gu_numel(bf, h, inter), word)
        dn = _aligned(e * self._dn_numel(bf, h, inter), word)
        gate_up, down = gate_up.contiguous(), down.contiguous()
        if self._pack(bf, gate_up.data_ptr(), down.data_ptr(), e, h, inter, gu.data_ptr(), dn.data_ptr(),
                      torch.get_num_threads()) != 0:
            raise RuntimeError(f"the MoE kernel's packing refused {tuple(gate_up.shape)}")
        return PackedExperts(gu, dn, gate_up.dtype, e, h, inter)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                packed: PackedExperts) -> torch.Tensor:
        """x [T, H] (packed.dtype, unit stride along H), weights [T, k] (the router's, any
        float dtype: rounded to x's), experts [T, k] (each in [0, E)) -> [T, H]."""
        if x.dim() != 2 or x.dtype != packed.dtype or x.shape[1] != packed.hidden or x.stride(1) != 1:
            raise ValueError(f"the MoE kernel takes [rows, {packed.hidden}] {packed.dtype}, got {x.dtype} "
                             f"{tuple(x.shape)}")
        t = x.shape[0]
        if experts.shape != weights.shape or experts.dim() != 2 or experts.shape[0] != t:
            raise ValueError(f"experts {tuple(experts.shape)} and weights {tuple(weights.shape)} for {t} rows")
        ids = experts.to(torch.int64).contiguous()
        w = weights.to(torch.float32).contiguous()
        out = torch.empty(t, packed.hidden, dtype=x.dtype)
        rc = self._fn(DTYPES.index(x.dtype), x.data_ptr(), t, x.stride(0), ids.data_ptr(), w.data_ptr(),
                      ids.shape[1], packed.gate_up.data_ptr(), packed.down.data_ptr(), packed.num_experts,
                      packed.hidden, packed.intermediate, out.data_ptr(), packed.hidden, torch.get_num_threads())
        if rc == 2:
            raise MemoryError(f"the MoE kernel's scratch for {t} rows")
        if rc != 0:
            raise RuntimeError(f"the MoE kernel refused its arguments ({t} rows, experts outside "
                               f"0..{packed.num_experts - 1}?)")
        return out


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def load_moe_experts() -> MoeExperts | None:
    """The kernel, built on first use on this machine; None where it cannot run."""
    lib = native_lib.load(_SOURCE, "PRELUDE_MOE_EXPERTS", "the MoE experts kernel (torch's GEMMs serve them)")
    if lib is None:
        return None
    kernel = MoeExperts(lib)
    return kernel if kernel.takes(torch.float32) or kernel.takes(torch.bfloat16) else None
