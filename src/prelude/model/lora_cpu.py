"""The C LoRA delta for few-token CPU forwards (lora_cpu.c): one call per projection, each
token reading only its own adapter's slot. Built on first use like the other C kernels
(native_lib.py); `load_lora_kernel()` is None without a compiler or AVX2+FMA, or with
PRELUDE_LORA_KERNEL=0 (then the oneDNN all-slots path of model/lora.py runs)."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from prelude.model import native_lib

_SOURCE = Path(__file__).with_name("lora_cpu.c")
MAX_WIDTH = 1024
MAX_PACKED_WIDTH = MAX_WIDTH + 64  # lora_cpu.c's MAX_WP
MAX_OUT = 65536
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class StreamLayout:
    """Where the decode kernel on an AVX512-BF16 CPU reads a projection's slots
    (lora_bgmv_packed): a copy of each slot as one contiguous stream, A as [n2, Wp, 2]
    (pairs of inputs interleaved) then each target's diagonal block of B as
    [njp / 16, Rp / 2, 16, 2] (Rp: the rank rounded up to even, Wp: k Rp rounded up to 16,
    njp: the target's columns rounded up to 16). The row-major slots stay for the other
    paths (prefill, float32); the copy costs ~2/3 of them more memory (B's zero blocks are
    not copied) and took a decode step's LoRA deltas from 1.68 to 1.23 ms (one thread)."""

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


class _CallOperands(ctypes.Structure):
    """lora_cpu.c's LoraOperands."""

    _fields_ = [(name, ctypes.c_int) for name in ("n_in", "S", "W", "n_out", "k", "bf", "Wp", "Rp")] + [
        ("cols", ctypes.c_void_p), ("A", ctypes.c_void_p), ("B", ctypes.c_void_p), ("P", ctypes.c_void_p),
        ("stride", ctypes.c_long), ("boff", ctypes.c_long)]


@dataclass(frozen=True)
class SlotOperands:
    """One projection's stacked slots as the kernels take them, checked once when the slots
    are built (their storage never moves: loads copy into it), so a forward's call passes
    only its tokens' pointers: ~120 calls a decode step, where per-call checks in Python
    cost ~3% of the step."""

    dtype: torch.dtype
    n_in: int
    n_slots: int
    width: int
    n_out: int
    targets: int
    a_ptr: int
    b_ptr: int
    cols_ptr: int
    keep: tuple[torch.Tensor, ...]  # a, b, cols and streams, alive as long as these pointers
    # few-token calls read the StreamLayout copy where there is one: (Wp, Rp, its pointer,
    # elements per slot, A's elements) as lora_bgmv_packed takes them
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
        self._streamed = lib.lora_bgmv_packed
        self._streamed.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, ptr, ptr, c_long, ptr, c_long, c_long, ptr,
                                   c_long, ptr]
        self._streamed.restype = None
        self._decode = lib.lora_decode
        self._decode.argtypes = [ptr, c_int, ptr, c_long, ptr, c_long, ptr]
        self._decode.restype = None
        # The grouped many-token kernel and the decode kernel on StreamLayout copies are
        # built only where the CPU has AVX512-BF16.
        self.grouped = bool(lib.lora_sgmv_available())

    def fits(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        return (x.dtype in (torch.float32, torch.bfloat16) and a.dtype == b.dtype == x.dtype
                and a.shape[2] <= MAX_WIDTH and b.shape[2] <= MAX_OUT)

    def stream_layout(self, a: torch.Tensor, b: torch.Tensor, cols: torch.Tensor) -> StreamLayout | None:
        """The StreamLayout of slots `a` [S, in, W] and `b` [S, W, out] (bf16), or None where
        the decode kernel reads the row-major slots (no AVX512-BF16, float32, too wide)."""
        k = cols.numel() - 1
        if not (self.grouped and a.dtype == b.dtype == torch.bfloat16 and a.shape[2] % k == 0):
            return None
        layout = StreamLayout(a.shape[1], k, a.shape[2] // k, tuple(int(c) for c in cols))
        return layout if layout.wp <= MAX_PACKED_WIDTH else None

    def operands(self, a: torch.Tensor, b: torch.Tensor, cols: torch.Tensor,
                 streams: torch.Tensor | None = None) -> SlotOperands | None:
        """`a` [S, in, W], `b` [S, W, out] and `cols` (see delta_) checked for `run_`; None
        where the kernel does not take them. `streams`: their StreamLayout copy [S, stride]
        (see stream_layout), which few-token calls then read."""
        n_slots, n_in, width = a.shape
        if not (a.dtype == b.dtype and a.dtype in CPU_KERNEL_DTYPES and a.is_contiguous() and b.is_contiguous()
                and b.shape[:2] == (n_slots, width) and width <= MAX_WIDTH and b.shape[2] <= MAX_OUT
                and cols.dtype == torch.int32 and cols.is_contiguous() and width % (cols.numel() - 1) == 0
                and int(cols[-1]) == b.shape[2]):
            return None
        stream = None
        if streams is not None:
            layout = self.stream_layout(a, b, cols)
            if layout is None or not (streams.dtype == a.dtype and streams.is_contiguous()
                                      and streams.shape == (n_slots, layout.stride)):
                return None
            stream = (layout.wp, layout.rp, streams.data_ptr(), layout.stride, layout.a_size)
        keep = (a, b, cols) if streams is None else (a, b, cols, streams)
        return SlotOperands(a.dtype, n_in, n_slots, width, b.shape[2], cols.numel() - 1, a.data_ptr(), b.data_ptr(),
                            cols.data_ptr(), keep, stream)

    def run_(self, out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, ops: SlotOperands,
             grouped: bool) -> torch.Tensor:
        """`delta_` (grouped: `grouped_delta_`) on checked operands; x and out [T, in] and
        [T, out] with unit column stride, token_slots long [T] contiguous. Returns out."""
        tokens = x.shape[0]
        assert (x.dtype == out.dtype == ops.dtype and x.shape[1] == ops.n_in and out.shape == (tokens, ops.n_out)
                and x.stride(1) == 1 and out.stride(1) == 1 and token_slots.shape == (tokens,))
        if grouped:
            assert self.grouped and ops.dtype == torch.bfloat16
            _, _, streams, stride, a_size = ops.stream or (0, 0, None, 0, 0)  # the copy: no repack
            self._sgmv(tokens, ops.n_in, ops.n_slots, ops.width, ops.n_out, x.data_ptr(), x.stride(0), ops.a_ptr,
                       ops.b_ptr, out.data_ptr(), out.stride(0), token_slots.data_ptr(), ops.targets, ops.cols_ptr,
                       streams, stride, a_size)
        else:  # lora_bgmv_packed on the StreamLayout copy where there is one, else lora_bgmv
            self._decode(ops.call_ptr, tokens, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                         token_slots.data_ptr())
        return out

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
