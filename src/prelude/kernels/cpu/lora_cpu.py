"""The C LoRA delta for few-token CPU forwards (lora_cpu.c): one call per projection, each
token reading only its own adapter's slot. Built on first use like the other C kernels
(kernels/cpu/native_lib.py); `load_lora_kernel()` is None without a compiler or AVX2+FMA, or
with PRELUDE_LORA_KERNEL=0 (then the oneDNN all-slots path of model/lora/adapters.py runs)."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("lora_cpu.c")
MAX_WIDTH = 1024
MAX_PACKED_WIDTH = MAX_WIDTH + 64  # lora_cpu.c's MAX_WP
MAX_OUT = 65536
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class StreamLayout:
    """How the C kernels on an AVX512-BF16 CPU keep a projection's bf16 slots (model/lora/adapters.py's
    LoraSlots holds them only this way there): each slot one contiguous stream, A as
    [n2, Wp, 2] (pairs of inputs interleaved: vdpbf16ps operands as they are) then each
    target's diagonal block of B as [njp / 16, Rp / 2, 16, 2] (Rp: the rank rounded up to
    even, Wp: k Rp rounded up to 16, njp: the target's columns rounded up to 16). Against
    the row-major [S, in, k R] / [S, k R, out]: decode's LoRA deltas take less time (every
    token reads one sequential stream, no permutes), prefill reads it without repacking,
    and B's zero blocks (2/3 of q/k/v's, 1/2 of gate/up's) are not kept, about a third less
    memory per slot."""

    n_in: int
    k: int
    rank: int  # R: each target's rank in the row-major slots (W / k)
    cols: tuple[int, ...]  # the k + 1 target column bounds

    @property
    def rp(self) -> int:
        return self.rank + (self.rank & 1)

    @property
    def wp(self) -> int:
        return -(-self.k * self.rp // 16) * 16

    @property
    def a_size(self) -> int:
        return (self.n_in + 1) // 2 * self.wp * 2

    @property
    def b_size(self) -> int:
        return sum(-(-(hi - lo) // 16) * 16 * self.rp for lo, hi in zip(self.cols, self.cols[1:]))

    @property
    def stride(self) -> int:
        """Elements per slot."""
        return self.a_size + self.b_size

    def pack(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """One slot's stream [stride] from its row-major A [in, k R] and B [k R, out]."""
        k, r, rp, wp = self.k, self.rank, self.rp, self.wp
        n2 = (self.n_in + 1) // 2
        ap = a.new_zeros(2 * n2, wp)
        for j in range(k):
            ap[: self.n_in, j * rp : j * rp + r] = a[:, j * r : (j + 1) * r]
        parts = [ap.view(n2, 2, wp).transpose(1, 2).reshape(-1)]
        for j, (lo, hi) in enumerate(zip(self.cols, self.cols[1:])):
            njp = -(-(hi - lo) // 16) * 16
            bj = b.new_zeros(rp, njp)
            bj[:r, : hi - lo] = b[j * r : (j + 1) * r, lo:hi]
            parts.append(bj.view(rp // 2, 2, njp // 16, 16).permute(2, 0, 3, 1).reshape(-1))
        return torch.cat(parts)

    def unpack(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row-major slots A [S, in, k R] and block-diagonal B [S, k R, out] of streams
        [S, stride] (what torch's paths take: the kernels' fallbacks and tests)."""
        k, r, rp, wp = self.k, self.rank, self.rp, self.wp
        n_slots, n2 = streams.shape[0], (self.n_in + 1) // 2
        ap = streams[:, : self.a_size].view(n_slots, n2, wp, 2).transpose(2, 3).reshape(n_slots, 2 * n2, wp)
        a = torch.cat([ap[:, : self.n_in, j * rp : j * rp + r] for j in range(k)], dim=2)
        b = streams.new_zeros(n_slots, k * r, self.cols[-1])
        off = self.a_size
        for j, (lo, hi) in enumerate(zip(self.cols, self.cols[1:])):
            njp = -(-(hi - lo) // 16) * 16
            bj = streams[:, off : off + rp * njp].view(n_slots, njp // 16, rp // 2, 16, 2)
            b[:, j * r : (j + 1) * r, lo:hi] = bj.permute(0, 2, 4, 1, 3).reshape(n_slots, rp, njp)[:, :r, : hi - lo]
            off += rp * njp
        return a.contiguous(), b


class _CallOperands(ctypes.Structure):
    """lora_cpu.c's LoraOperands."""

    _fields_ = [(name, ctypes.c_int) for name in ("n_in", "S", "W", "n_out", "k", "bf", "Wp", "Rp")] + [
        ("cols", ctypes.c_void_p), ("A", ctypes.c_void_p), ("B", ctypes.c_void_p), ("P", ctypes.c_void_p),
        ("stride", ctypes.c_long), ("boff", ctypes.c_long)]


@dataclass(frozen=True)
class SlotOperands:
    """One projection's stacked slots as the kernels take them, checked once when the slots
    are built (their storage never moves: loads copy into it), so a forward's call passes
    only its tokens' pointers: about a hundred calls a decode step, where per-call checks
    in Python would add a visible share of the step."""

    dtype: torch.dtype
    n_in: int
    n_slots: int
    width: int
    n_out: int
    targets: int
    a_ptr: int
    b_ptr: int
    cols_ptr: int
    keep: tuple[torch.Tensor, ...]  # what the pointers point into, alive as long as they are
    # slots kept in a StreamLayout (a_ptr, b_ptr 0): (Wp, Rp, the streams' pointer, elements
    # per slot, A's elements) as lora_bgmv_packed and lora_sgmv take them
    stream: tuple[int, int, int, int, int] | None = None
    call: _CallOperands | None = None  # all of the above for lora_decode (built in __post_init__)
    call_ptr: int = 0

    def __post_init__(self) -> None:
        wp, rp, streams, stride, a_size = self.stream or (0, 0, 0, 0, 0)
        call = _CallOperands(self.n_in, self.n_slots, self.width, self.n_out, self.targets,
                             int(self.dtype == torch.bfloat16), wp, rp, self.cols_ptr, self.a_ptr, self.b_ptr,
                             streams or None, stride, a_size)
        object.__setattr__(self, "call", call)
        object.__setattr__(self, "call_ptr", ctypes.addressof(call))


class LoraKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.lora_bgmv
        c_int, c_long, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
        self._fn.argtypes = [c_int, c_int, c_int, c_int, c_int, ptr, c_long, ptr, ptr, ptr, c_long, ptr, c_int, c_int,
                             ptr]
        self._fn.restype = None
        self._sgmv = lib.lora_sgmv
        self._sgmv.argtypes = [c_int, c_int, c_int, c_int, c_int, ptr, c_long, ptr, ptr, ptr, c_long, ptr, c_int, ptr,
                               ptr, c_long, c_long]
        self._sgmv.restype = None
        self._decode = lib.lora_decode
        self._decode.argtypes = [ptr, c_int, ptr, c_long, ptr, c_long, ptr]
        self._decode.restype = None
        # The grouped many-token kernel and the kernels' StreamLayout are built only where
        # the CPU has AVX512-BF16.
        self.grouped = bool(lib.lora_sgmv_available())

    def fits(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        return (x.dtype in (torch.float32, torch.bfloat16) and a.dtype == b.dtype == x.dtype
                and a.shape[2] <= MAX_WIDTH and b.shape[2] <= MAX_OUT)

    def stream_layout(self, dtype: torch.dtype, n_in: int, width: int, cols: Sequence[int]) -> StreamLayout | None:
        """The StreamLayout of slots A [S, n_in, width] / B [S, width, cols[-1]] with k =
        len(cols) - 1 targets, or None where the kernels take row-major slots (no
        AVX512-BF16, float32, too wide)."""
        k = len(cols) - 1
        if not (self.grouped and dtype == torch.bfloat16 and k >= 1 and width % k == 0 and width <= MAX_WIDTH
                and cols[-1] <= MAX_OUT):
            return None
        layout = StreamLayout(n_in, k, width // k, tuple(int(c) for c in cols))
        return layout if layout.wp <= MAX_PACKED_WIDTH else None

    def stream_operands(self, layout: StreamLayout, streams: torch.Tensor, cols: torch.Tensor) -> SlotOperands:
        """`run_`'s operands for slots kept in `layout` (streams [S, stride] bf16, cols the
        layout's bounds as int32): both kernels read the streams."""
        n_slots = streams.shape[0]
        assert (streams.dtype == torch.bfloat16 and streams.is_contiguous() and streams.shape == (n_slots, layout.stride)
                and cols.dtype == torch.int32 and cols.is_contiguous() and tuple(cols.tolist()) == layout.cols)
        return SlotOperands(torch.bfloat16, layout.n_in, n_slots, layout.k * layout.rank, layout.cols[-1], layout.k,
                            0, 0, cols.data_ptr(), (streams, cols),
                            (layout.wp, layout.rp, streams.data_ptr(), layout.stride, layout.a_size))

    def operands(self, a: torch.Tensor, b: torch.Tensor, cols: torch.Tensor) -> SlotOperands | None:
        """Row-major slots `a` [S, in, W], `b` [S, W, out] and `cols` (see delta_) checked
        for `run_`; None where the kernel does not take them."""
        n_slots, n_in, width = a.shape
        if not (a.dtype == b.dtype and a.dtype in CPU_KERNEL_DTYPES and a.is_contiguous() and b.is_contiguous()
                and b.shape[:2] == (n_slots, width) and width <= MAX_WIDTH and b.shape[2] <= MAX_OUT
                and cols.dtype == torch.int32 and cols.is_contiguous() and width % (cols.numel() - 1) == 0
                and int(cols[-1]) == b.shape[2]):
            return None
        return SlotOperands(a.dtype, n_in, n_slots, width, b.shape[2], cols.numel() - 1, a.data_ptr(), b.data_ptr(),
                            cols.data_ptr(), (a, b, cols))

    def run_(self, out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, ops: SlotOperands,
             grouped: bool) -> torch.Tensor:
        """`delta_` (grouped: `grouped_delta_`) on checked operands; x and out [T, in] and
        [T, out] with unit column stride, token_slots long [T] contiguous. Returns out."""
        tokens = x.shape[0]
        assert (x.dtype == out.dtype == ops.dtype and x.shape[1] == ops.n_in and out.shape == (tokens, ops.n_out)
                and x.stride(1) == 1 and out.stride(1) == 1 and token_slots.shape == (tokens,))
        if grouped:
            assert self.grouped and ops.dtype == torch.bfloat16
            _, _, streams, stride, a_size = ops.stream or (0, 0, None, 0, 0)  # StreamLayout slots: no repack
            self._sgmv(tokens, ops.n_in, ops.n_slots, ops.width, ops.n_out, x.data_ptr(), x.stride(0), ops.a_ptr,
                       ops.b_ptr, out.data_ptr(), out.stride(0), token_slots.data_ptr(), ops.targets, ops.cols_ptr,
                       streams, stride, a_size)
            return out
        return self.decode_(out, x, token_slots, ops)  # lora_bgmv_packed on StreamLayout slots, else lora_bgmv

    def decode_(self, out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, ops: SlotOperands) -> torch.Tensor:
        """`run_` of a few-token call (not grouped), the checks it needs and no more."""
        tokens, n_in = x.shape
        assert (n_in == ops.n_in and out.shape == (tokens, ops.n_out) and x.stride(1) == 1 and out.stride(1) == 1
                and token_slots.shape == (tokens,) and x.dtype == out.dtype == ops.dtype)
        self._decode(ops.call_ptr, tokens, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                     token_slots.data_ptr())
        return out

    def delta_(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               token_slots: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """out[t] += (x[t] @ a[s]) @ b[s] for s = token_slots[t] >= 0 (a: [S, in, W], b:
        [S, W, out], both contiguous; out and x rows with unit column stride). `cols`
        (int32, k + 1 column bounds): b is block diagonal over k targets, row block j
        nonzero only in columns cols[j]:cols[j+1] (None: one target, all columns). Returns out."""
        tokens, n_in = x.shape
        n_slots, width, n_out = b.shape
        assert out.dtype == x.dtype and out.shape == (tokens, n_out) and a.shape == (n_slots, n_in, width)
        assert a.is_contiguous() and b.is_contiguous() and x.stride(1) == 1 and out.stride(1) == 1
        assert token_slots.dtype == torch.long and token_slots.is_contiguous() and token_slots.shape == (tokens,)
        if cols is None:
            cols = torch.tensor([0, n_out], dtype=torch.int32)
        k = cols.numel() - 1
        assert cols.dtype == torch.int32 and width % k == 0 and int(cols[-1]) == n_out
        self._fn(tokens, n_in, n_slots, width, n_out, x.data_ptr(), x.stride(0), a.data_ptr(), b.data_ptr(),
                 out.data_ptr(), out.stride(0), token_slots.data_ptr(), int(x.dtype == torch.bfloat16), k,
                 cols.data_ptr())
        return out

    def grouped_delta_(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The same sum as `delta_` for many tokens (bf16 only, where `grouped`): tokens
        grouped by slot, each slot's A and B repacked once per call, tiles of tokens
        sharing them. Returns out."""
        tokens, n_in = x.shape
        n_slots, width, n_out = b.shape
        assert self.grouped and x.dtype == torch.bfloat16
        assert out.dtype == x.dtype and out.shape == (tokens, n_out) and a.shape == (n_slots, n_in, width)
        assert a.is_contiguous() and b.is_contiguous() and x.stride(1) == 1 and out.stride(1) == 1
        assert token_slots.dtype == torch.long and token_slots.is_contiguous() and token_slots.shape == (tokens,)
        assert cols.dtype == torch.int32 and width % (cols.numel() - 1) == 0
        self._sgmv(tokens, n_in, n_slots, width, n_out, x.data_ptr(), x.stride(0), a.data_ptr(), b.data_ptr(),
                   out.data_ptr(), out.stride(0), token_slots.data_ptr(), cols.numel() - 1, cols.data_ptr(), None, 0, 0)
        return out


def build(flags: tuple[str, ...] = native_lib.FLAGS) -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE, flags)


@functools.cache
def load_lora_kernel() -> LoraKernel | None:
    lib = native_lib.load(_SOURCE, "PRELUDE_LORA_KERNEL", "the C LoRA kernel (decode uses the oneDNN all-slots path)")
    return None if lib is None else LoraKernel(lib)
