"""Weight projections y = x W^T (+ b), with oneDNN-prepacked weights on CPU where it pays.

Reordering a weight once into oneDNN's blocked layout (the op inductor's freezing pass
uses) makes the few-row GEMMs of decode fast: in bf16 on an AVX512-BF16 CPU (bit-identical
to F.linear), and in float32, where MKL's few-row sgemm is the weak spot (equal to fp32
rounding). At a few hundred rows the two are close on an AVX2-only CPU.
On an AVX512-BF16 CPU the bf16 packed copy is faster at prefill sizes too, and F.linear is a oneDNN kernel
per row count there too (the packed one is no slower to create and holds less scratch),
so every bf16 call takes it: otherwise the judge's trunk (1,024-row steps) would run
F.linear whenever no decode had made the copy. The copy is made on the first call, so a
process that only prefills holds the projections twice as well (PRELUDE_PREPACK=0 holds
one). In float32 F.linear is MKL's sgemm, which compiles nothing per row count; on a
non-Intel AVX-512 CPU it runs AVX2 code and is much slower than oneDNN's packed kernels,
but each new row count costs a packed kernel to create: float32 takes the packed copy at
decode sizes and at 128, 256, ... 2048 rows only (a bounded set); a longer or off-step
call runs its whole steps there and the rest after (in AVX2 code oneDNN is at least even
with MKL). MKL picks its code by CPU vendor, so on a non-Intel AVX-512 CPU the counts
between the steps are padded up to the next step instead (zero rows, at most
PACKED_PAD_MAX times the rows): the packed kernel on the padded rows is still faster than
MKL on the exact ones (a float32 judge's steps are such counts), and at the bound the two
are even.
So a prefill's token count, new almost every time, makes a new kernel per projection
shape in bf16 either way; oneDNN keeps them, each with its own scratch memory (a soak grew
by hundreds of MiB), so its caches are bounded (ONEDNN_CACHE_BOUNDS below). Both copies
are kept: projection weights are held twice on a prepacking CPU. GPUs and float16 use
plain F.linear.

Up to 16 float32 rows through an LM head (`head=True`) of at least 4 MiB in float32 (c=1
to 16) take row_gemv.c instead, on an AVX-512 CPU: one row of 64-256 streams the plain
weight faster than oneDNN's one-row kernel (wider rows keep oneDNN for one row), 2-16 rows
a blocked copy of it (made on their first call, held beside the others), faster than
oneDNN's packed kernels; each in its own fixed sum order (equal to fp32 rounding, as
oneDNN's is to MKL's).

On a CPU with AMX-BF16, bf16 calls of up to 32 rows (decode) take bf16_rows.c's tile form
over the plain weight instead of oneDNN's packed copy, which pays a fixed cost per call
before any work that dominates a small model's decode step (past 32 rows oneDNN is ahead).

A GGUF checkpoint's projections can also come in their stored block format (Q4_0, Q4_1,
Q8_0: kernels/ggml_quants.py). Few-row calls then read the blocks (kernels/cpu/quant_gemm.py:
float32 rows on any AVX2 CPU, bf16 rows on an AVX512-BF16 one): far fewer bytes, the same
weights. The blocks' work grows with every row, so up to how many rows they pay is
measured per CPU and dtype (model/fast_paths/decode_routes.py; QuantPath.max_rows). The
current figures of every route are in docs/benchmarks.md.
"""

from __future__ import annotations

import enum
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.amx_gemm import AmxGemm, load_amx_gemm
from prelude.kernels.cpu.bf16_rows import TILE_MAX_ROWS, Bf16Rows, load_bf16_rows
from prelude.kernels.cpu.quant_gemm import QuantKernel
from prelude.kernels.cpu.f32_gemm import F32Gemm, load_f32_gemm
from prelude.kernels.ggml_quants import GgmlQuants
from prelude.kernels.cpu.row_gemv import BLOCKED_MAX_ROWS, RowGemv, load_row_gemv


ROW_GEMV_CHUNKED_MAX_ROWS = 64  # a row-GEMV head's calls up to this many rows go 16 at a time
PACKED_MAX_ROWS = 32  # decode batches take the packed copy at any row count (bf16: every call)
# The packed kernel gives a row the same bits at every row count up to here, MKL's F.linear
# does not (nor at another thread count): identical requests batched differently answer
# identically (tests/entrypoints/test_multiproc_front.py's embeddings). So few-row float32
# calls keep it although F.linear is faster on a small weight (docs/benchmarks.md).
# Larger float32 calls take it at these row counts only (a bounded set: each new count is a
# packed kernel to create, where MKL's F.linear creates none): 128 .. 2048 in steps of 128.
# oneDNN's kernels are much faster than MKL's on a non-Intel AVX-512 CPU (MKL runs its AVX2
# code there), somewhat faster in AVX2 code (PRELUDE_CPU_ISA=avx2 with
# ONEDNN_MAX_CPU_ISA=AVX2), and even on an AVX2-only CPU: never slower, so every CPU takes
# them. In bf16, whose F.linear is a oneDNN kernel too, splitting other counts into such tiles
# plus a remainder lost (every call streams the weight again, and the tiles' outputs are
# copied together), and so did padding; against float32's MKL both gain (float32_pieces,
# PACKED_PAD_MAX).
PACKED_ROW_STEP = 128
PACKED_STEP_MAX_ROWS = 2048
PACKED_PAD_MAX = 1.6  # float32 on a non-Intel AVX-512 CPU: pad a call up to the next step within this factor
# float32 calls cut into pieces (float32_pieces) only over weights of at least this many
# elements: over the free model's 128-wide ones the extra call and the copy of the outputs
# cost more than the steps save, over SmolLM2's (576 x 576 and up) the cut about halves
# the time.
PIECES_MIN_WEIGHT = 1 << 18
QUANT_MAX_ROWS = 8  # calls of up to this many rows read GGUF blocks, unless measured otherwise
# Bounds oneDNN's and ideep's per-shape caches (defaults 1,024 entries each). Every bf16
# GEMM goes through oneDNN, packed or not (F.linear too), and each row count is a new
# kernel that holds its own scratch memory, growing with its rows: a prefill step of a few
# thousand tokens caches tens of MiB over a decoder's weight shapes, and its token count
# rarely comes back. Bounded at 256, a long embeddings job grew by about a GiB (the cache
# full of such steps); at 16, the last 3-4 row counts stay (a decode batch's 5 shapes, the
# head's included, survive the prefill steps between two of its steps): the job grows by
# tens of MiB. A row count evicted and seen again pays its kernels' creation again.
ONEDNN_CACHE_BOUNDS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}


# A packed copy is made once, by whichever thread asks first: the model's start makes oneDNN's
# on a thread of its own (Decoder.make_packed_copies) while a call may need one.
_COPIES_LOCK = threading.Lock()


def bound_onednn_caches() -> None:
    """Bound oneDNN's and ideep's per-shape caches. Each reads its bound once, at its first
    use, so this runs before the first oneDNN GEMM of the process (a Projection's
    construction, and the runner's before it builds any model); a value the user set is kept."""
    for name, value in ONEDNN_CACHE_BOUNDS.items():
        os.environ.setdefault(name, value)


def prepack_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
        and os.environ.get("PRELUDE_PREPACK", "1") != "0"
    )


class Route(enum.Enum):
    """Which GEMM serves a call (Projection.route decides, for Python and the C layer loop)."""

    OWN_GEMM = "own_gemm"  # amx_gemm.c (bf16) or f32_gemm.c (float32) over its packed copy
    QUANT_BLOCKS = "quant_blocks"  # the GGUF quantized blocks (quant_gemm.c)
    TILE_ROWS = "tile_rows"  # bf16_rows.c's tile form over the plain weight (AMX)
    ROW_GEMV = "row_gemv"  # row_gemv.c (a float32 LM head's few-row calls)
    FLOAT32_PIECES = "float32_pieces"  # float32 cut into oneDNN's step sizes, the rest after
    ONEDNN = "onednn"  # oneDNN's prepacked copy
    TORCH = "torch"  # F.linear over the plain weight


# The routes the C layer loop calls itself, by layer_loop.c's VIA_* codes
C_ROUTES = {Route.QUANT_BLOCKS: 0, Route.TILE_ROWS: 1, Route.OWN_GEMM: 2}
C_ROUTE_SLOTS = 3  # layer_loop.c's Proj holds this many (upto, via) intervals


@dataclass(frozen=True)
class QuantPath:
    """A projection's GGUF blocks, the kernel that reads them, and the most rows a call may
    have to read them (decode_routes.py measures where they stop paying on this CPU)."""

    blocks: GgmlQuants
    kernel: QuantKernel
    max_rows: int = QUANT_MAX_ROWS


class Projection:
    """A frozen linear layer over `weight` [out, in]. Calls of at most QUANT_MAX_ROWS rows
    read `blocks` where given; prepacked, bf16 calls of up to TILE_MAX_ROWS rows take the
    tile form on an AMX CPU (tile_rows_take), and a oneDNN copy serves the rest of the calls
    whose row count packed_rows takes (float32 pads some up)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = False,
                 blocks: QuantPath | None = None, head: bool = False) -> None:
        if blocks is not None and (blocks.blocks.out_features, blocks.blocks.in_features) != tuple(weight.shape):
            raise ValueError(f"blocks of {blocks.blocks.out_features}x{blocks.blocks.in_features} for a weight "
                             f"of {tuple(weight.shape)}")
        bound_onednn_caches()  # before this weight's first GEMM, packed or not
        self.weight = weight
        self.bias = bias
        self.blocks = blocks
        self.out_features = weight.shape[0]
        # Packed on the first call that takes it, not at load: reordering every projection
        # is a sizeable share of start-up, and a float32 server that only scores (at row
        # counts off the steps) never needs it. A bf16 server makes them at load
        # (make_packed_copy): every bf16 call takes them, so its first prompt would.
        self._want_packed = prepack
        self._packed: torch.Tensor | None = None
        # Few-row calls of a wide float32 LM head (`head`) stream it through row_gemv.c (see
        # the module docstring). Only the head: its 2-16 row calls keep a blocked copy
        # beside the weight, which for a decoder's wide projections (Qwen3-0.6B's gate_up:
        # 25 MB a layer) would cost the trunk's size again, for a gain not shown there.
        self._row_gemv: RowGemv | None = (load_row_gemv() if head and prepack and blocks is None
                                          and RowGemv.takes(weight) else None)
        # bf16 decode-sized calls on the tile unit over the plain weight (no copy)
        self._bf16_rows: Bf16Rows | None = tile_rows_kernel(weight) if prepack else None
        self._blocked: torch.Tensor | None = None  # the row GEMV's blocked copy, for 2..16 rows
        # bf16 calls past the few-row routes up to its max_rows through amx_gemm.c (the AMX
        # tile unit, or AVX512-BF16's dot product), over a copy of its own beside oneDNN's
        # (not a head: its calls of that many rows, prompt logprobs, are rare, and its copy large)
        self._amx: AmxGemm | None = amx_gemm_kernel(weight) if prepack and not head else None
        self._amx_packed: torch.Tensor | None = None
        # float32 calls past the few-row routes up to its max_rows through f32_gemm.c (AVX2 + FMA,
        # CPUs without AVX-512), over a copy of its own
        self._f32: F32Gemm | None = f32_gemm_kernel(weight) if prepack and not head else None
        self._f32_packed: torch.Tensor | None = None
        self._few_rows_max = self._few_rows_routes()
        self._one_route = False  # take_one_route: every call through one route

    @property
    def tile_form(self) -> Bf16Rows | None:
        """bf16_rows.c where this projection's bf16 calls of 1..TILE_MAX_ROWS rows run its tile form."""
        return self._bf16_rows

    def _few_rows_routes(self) -> int:
        """The most rows a bf16 call may have for a route of its own (blocks, the tile form)
        to take it: every longer bf16 call runs the packed copy as it is (the direct call)."""
        tile = TILE_MAX_ROWS if self._bf16_rows is not None else 0
        return max(tile, self.blocks.max_rows if self.blocks is not None else 0)

    def take_one_route(self) -> bool:
        """Batch invariance: from now on every call, of any row count, takes one route, so a
        row's sums never depend on how many rows share its call (the blocks, the tile form,
        amx_gemm.c and the row GEMV each sum in an order of their own, and which one a call
        takes follows its row count):
        - amx_gemm.c's dot-product form where it serves (bf16 on AVX512-BF16 without AMX): a
          row's k pairs in order whatever the rows and threads of its call, and faster than
          oneDNN's packed copy up to 1,024 rows there and even at 2,048 (amx_gemm.py's MAX_ROWS);
        - f32_gemm.c where it serves (float32 on AVX2 without AVX-512): a row's k in order
          whatever the rows and threads of its call, and faster than oneDNN's (f32_gemm.py);
        - else oneDNN's packed copy, one-row calls padded to two rows. Checked row by row on
          an AVX512-BF16 CPU, 1-1,600 rows over SmolLM2's five shapes: bit-equal in bf16;
          in float32 a one-row call differed from two rows at k = 1,536, and every count from
          two on agreed, hence the padding.
        False where this projection has neither (not a CPU, or PRELUDE_PREPACK=0): its calls
        stay as they were. The copies are made as before (model.make_packed_copies, or the
        first call)."""
        dot_product = self._amx if self._amx is not None and self._amx.form == "dot-product" else None
        if dot_product is None and self._f32 is None and not self._want_packed:
            return False
        self.blocks, self._bf16_rows, self._amx = None, None, dot_product
        if dot_product is None:
            self._amx_packed = None
        self._row_gemv, self._blocked = None, None
        self._few_rows_max = 0
        self._one_route = True
        return True

    def _one_route_call(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        gemm = self.own_gemm
        if gemm is not None and x.dtype == gemm.dtype:
            return gemm.linear(rows.contiguous(), self.gemm_copy(), self.out_features,  # type: ignore[arg-type]
                               self.bias).reshape(*x.shape[:-1], self.out_features)
        packed = self._packed_weight()
        if packed is None:  # no oneDNN reorder on this CPU after all
            return F.linear(x, self.weight, self.bias)
        return self._packed_call(x, rows, packed, max(rows.shape[0], 2))

    def _packed_call(self, x: torch.Tensor, rows: torch.Tensor, packed: torch.Tensor, take: int) -> torch.Tensor:
        """x's rows through the packed copy as a call of `take` rows (zero rows padded on: no
        NaN or subnormals in the rows computed and dropped), shaped as x."""
        n = rows.shape[0]
        rows = rows.contiguous() if take == n else F.pad(rows, (0, 0, 0, take - n))
        out = packed_linear(rows, packed, self.bias)[:n]
        return out.reshape(*x.shape[:-1], self.out_features)

    def limit_blocks(self, max_rows: int) -> None:
        """Read the blocks for calls of at most `max_rows` rows (0: never); the model sets
        this once, when it is built, from decode_routes.choose."""
        if self.blocks is not None:
            self.blocks = replace(self.blocks, max_rows=max_rows) if max_rows > 0 else None
        self._few_rows_max = self._few_rows_routes()

    @property
    def packed(self) -> bool:
        """Whether decode-sized calls take a path of their own (blocks, or a prepacked
        copy made on first use): then the projection itself is the operand, not its weight."""
        return self._want_packed or self.blocks is not None

    @property
    def amx_gemm(self) -> AmxGemm | None:
        """amx_gemm.c where this projection's bf16 calls past the few-row routes up to
        its max_rows rows run it."""
        return self._amx

    def amx_copy(self) -> torch.Tensor | None:
        """amx_gemm.c's packed copy (made now if it is not yet), or None where it does not serve."""
        return None if self._amx is None else self._amx_weight()

    def amx_copy_from(self, source: Callable[[Callable[[], torch.Tensor]], torch.Tensor]) -> None:
        """amx_gemm.c's copy as `source(make)` gives it: one an earlier start kept
        (model/loading/prepared.py), or make()'s. Nothing where amx_gemm.c does not serve."""
        if self._amx is None:
            return
        packed = source(self._amx_weight)
        if packed.dtype != torch.int32 or packed.numel() * 2 != self.weight.numel():
            raise ValueError(f"an AMX copy of {packed.dtype} x {packed.numel()} for a weight of "
                             f"{tuple(self.weight.shape)}")
        self._amx_packed = packed

    @property
    def f32_gemm(self) -> F32Gemm | None:
        """f32_gemm.c where this projection's float32 calls past the few-row routes up to its
        max_rows rows run it."""
        return self._f32

    @property
    def own_gemm(self) -> AmxGemm | F32Gemm | None:
        """The GEMM of our own that serves this projection's calls past its few-row routes:
        amx_gemm.c (bf16) or f32_gemm.c (float32), whichever its weight's dtype and this CPU
        give it, or None."""
        return self._amx if self._amx is not None else self._f32

    def gemm_copy(self) -> torch.Tensor | None:
        """The copy of the GEMM of our own that serves this projection (amx_gemm.c's in bf16,
        f32_gemm.c's in float32; made now if not yet), or None where neither does."""
        if self._amx is not None:
            return self._amx_weight()
        if self._f32 is not None:
            return self._lazy_copy("_f32_packed", self._f32)
        return None

    def _lazy_copy(self, attr: str, kernel: AmxGemm | F32Gemm) -> torch.Tensor:
        """The copy held in `attr`, packed by `kernel` once, by whichever thread asks first."""
        if getattr(self, attr) is None:
            with _COPIES_LOCK:
                if getattr(self, attr) is None:
                    setattr(self, attr, kernel.pack(self.weight))
        return getattr(self, attr)

    def _amx_weight(self) -> torch.Tensor:
        return self._lazy_copy("_amx_packed", self._amx)  # type: ignore[arg-type]

    def _packed_weight(self) -> torch.Tensor | None:
        if self._packed is None and self._want_packed:
            with _COPIES_LOCK:
                if self._packed is None and self._want_packed:
                    bound_onednn_caches()
                    try:
                        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
                    except (RuntimeError, AttributeError):  # op missing, or no bf16 reorder on this CPU
                        self._want_packed = False
        return self._packed

    @property
    def reads_onednn_copy(self) -> bool:
        """Whether some call may run oneDNN's packed copy (not where the batch-invariant one
        route is a GEMM of our own: amx_gemm.c's or f32_gemm.c's)."""
        return self._want_packed and not (self._one_route and self.own_gemm is not None)

    def make_packed_copy(self) -> bool:
        """Make oneDNN's packed copy now (see ExecutorConfig.pack_at_start); whether there is one."""
        return self._packed_weight() is not None

    def runs_row_gemv(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a call of `rows` rows runs row_gemv.c's kernels only (every 16-row chunk on
        the blocked copy, a chunk of one row on the one-row kernel): what the greedy head
        (head_argmax.py) repeats bit for bit."""
        return (self._row_gemv is not None and dtype == torch.float32 and 0 < rows <= ROW_GEMV_CHUNKED_MAX_ROWS
                and (rows % BLOCKED_MAX_ROWS != 1 or self._row_gemv.one_row_pays(self.weight)))

    def route(self, rows: int, dtype: torch.dtype) -> Route:
        """The one place a call's GEMM is chosen: which route a call of `rows` rows in
        `dtype` takes (__call__ runs it; the C layer loop is given the same answers through
        c_routes)."""
        if self._one_route:
            gemm = self.own_gemm
            return Route.OWN_GEMM if gemm is not None and dtype == gemm.dtype else Route.ONEDNN
        if self._amx is not None and dtype == torch.bfloat16 and self._few_rows_max < rows <= self._amx.max_rows:
            return Route.OWN_GEMM
        if self.blocks is not None and 0 < rows <= self.blocks.max_rows and self.blocks.kernel.takes(dtype):
            return Route.QUANT_BLOCKS
        if self._bf16_rows is not None and dtype == torch.bfloat16 and 0 < rows <= TILE_MAX_ROWS:
            return Route.TILE_ROWS
        if self._f32 is not None and dtype == torch.float32 and self._few_rows_max < rows <= self._f32.max_rows:
            return Route.OWN_GEMM
        if self._row_gemv is not None and dtype == torch.float32 and 0 < rows <= ROW_GEMV_CHUNKED_MAX_ROWS:
            if rows > 1 or self._row_gemv.one_row_pays(self.weight):
                return Route.ROW_GEMV
        take = packed_rows(rows, dtype)
        if (not take and dtype == torch.float32 and rows > PACKED_ROW_STEP and self.weight.numel() >= PIECES_MIN_WEIGHT
                and self._want_packed):
            return Route.FLOAT32_PIECES
        return Route.ONEDNN if take and self._want_packed else Route.TORCH

    def c_routes(self, dtype: torch.dtype) -> tuple[tuple[int, Route], ...]:
        """route()'s answers from one row up as intervals (the most rows, the route), as far as
        they are routes the C layer loop calls itself (C_ROUTES): every row count up to the
        last interval's bound has a C route, the next one none. Exact because route() only
        compares the row count with the bounds taken as the intervals' ends here."""
        bounds = {1, TILE_MAX_ROWS, self._few_rows_max, BLOCKED_MAX_ROWS, ROW_GEMV_CHUNKED_MAX_ROWS}
        bounds |= {g.max_rows for g in (self._amx, self._f32) if g is not None}
        bounds |= {self.blocks.max_rows} if self.blocks is not None else set()
        intervals: list[tuple[int, Route]] = []
        for upto in sorted(b for b in bounds if b > 0):
            route = self.route(upto, dtype)
            if route not in C_ROUTES:
                break
            if intervals and intervals[-1][1] is route:
                intervals[-1] = (upto, route)
            else:
                intervals.append((upto, route))
        return tuple(intervals)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._one_route and x.numel():
            return self._one_route_call(x)
        # A bf16 prefill's calls ([tokens, features], past the few-row routes) straight to the
        # packed copy: the general path's reshapes, slice and checks add up over a short
        # prefill's hundred-odd calls (the same op on the same rows).
        if (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > self._few_rows_max
                and x.is_contiguous()):
            if self._amx is not None and x.shape[0] <= self._amx.max_rows:
                return self._amx.linear(x, self._amx_weight(), self.out_features, self.bias)
            if self._packed is not None:
                return packed_linear(x, self._packed, self.bias)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        route = self.route(n, x.dtype)
        if route is Route.OWN_GEMM:
            gemm = self.own_gemm
            return gemm.linear(rows.contiguous(), self.gemm_copy(), self.out_features,  # type: ignore[union-attr, arg-type]
                               self.bias).reshape(*x.shape[:-1], self.out_features)
        if route is Route.QUANT_BLOCKS:
            return self.blocks.kernel.linear(x, self.blocks.blocks, self.bias)  # type: ignore[union-attr]
        if route is Route.TILE_ROWS:
            return self._bf16_rows.linear(x, self.weight, self.bias)  # type: ignore[union-attr]
        if route is Route.ROW_GEMV:
            assert self._row_gemv is not None
            if n > BLOCKED_MAX_ROWS:
                # A head's decode-sized calls past 16 rows go 16 at a time through the calls below,
                # whose sums the greedy head (greedy_head.py) repeats without the logits.
                return torch.cat([self(chunk) for chunk in rows.split(BLOCKED_MAX_ROWS)]).reshape(
                    *x.shape[:-1], self.out_features)
            if n > 1:
                if self._blocked is None:  # on the first few-row call: a server that only scores never needs it
                    self._blocked = self._row_gemv.block(self.weight)
                return self._row_gemv.rows_linear(x, self._blocked, self.out_features, self.bias)
            return self._row_gemv.linear(x, self.weight, self.bias)
        if route is Route.FLOAT32_PIECES and self._packed_weight() is not None:
            # float32 that no one packed call takes: whole steps on the packed copy, the rest after
            pieces = float32_pieces(n)
            return torch.cat([self(piece) for piece in rows.split(pieces)]).reshape(*x.shape[:-1], self.out_features)
        take = packed_rows(n, x.dtype)
        packed = self._packed_weight() if route is Route.ONEDNN else None
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return self._packed_call(x, rows, packed, take)


def tile_rows_kernel(weight: torch.Tensor) -> Bf16Rows | None:
    """bf16_rows.c where its tile form takes every whole block of calls through `weight`
    (bf16, k a multiple of 32, AMX-BF16 usable here), else None."""
    kernel = load_bf16_rows()
    return kernel if kernel is not None and kernel.tile_form_takes(weight) else None


def amx_gemm_kernel(weight: torch.Tensor) -> AmxGemm | None:
    """amx_gemm.c where it serves `weight`'s bf16 calls past the few-row routes up to its
    max_rows rows (AVX512-BF16 or AMX-BF16 usable here, both widths multiples of 32), else
    None."""
    kernel = load_amx_gemm()
    return kernel if kernel is not None and kernel.takes(weight) else None


def f32_gemm_kernel(weight: torch.Tensor) -> F32Gemm | None:
    """f32_gemm.c where it serves `weight`'s float32 calls past the few-row routes up to its
    max_rows rows (a CPU with AVX2 + FMA and no AVX-512, out a multiple of 8), else None."""
    kernel = load_f32_gemm()
    return kernel if kernel is not None and kernel.takes(weight) else None


def own_gemm_kernel(weight: torch.Tensor) -> AmxGemm | F32Gemm | None:
    """The GEMM of our own that serves `weight`'s calls past the few-row routes, if any."""
    return amx_gemm_kernel(weight) or f32_gemm_kernel(weight)


def tile_rows_take(kernel: Bf16Rows | None, x: torch.Tensor, rows: int) -> bool:
    """Whether a call of `rows` rows of x runs the tile form (`kernel`: the projection's)."""
    return kernel is not None and x.dtype == torch.bfloat16 and 0 < rows <= TILE_MAX_ROWS


def dense_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, kernel: Bf16Rows | None,
                 bias: torch.Tensor | None = None, gemm: AmxGemm | F32Gemm | None = None,
                 gemm_copy: torch.Tensor | None = None) -> torch.Tensor:
    """What a prepacked projection runs for a call that does not read GGUF blocks: the tile
    form where tile_rows_take says so, else the GEMM of our own (amx_gemm.c in bf16,
    f32_gemm.c in float32) over `gemm_copy` up to its max_rows where it serves, else oneDNN
    over `packed` (decode_routes.py times this against the blocks)."""
    rows = x.reshape(-1, x.shape[-1])
    if tile_rows_take(kernel, x, rows.shape[0]):
        return kernel.linear(x, weight, bias)  # type: ignore[union-attr]
    if gemm is not None and gemm_copy is not None and x.dtype == gemm.dtype and rows.shape[0] <= gemm.max_rows:
        return gemm.linear(rows.contiguous(), gemm_copy, weight.shape[0], bias).reshape(*x.shape[:-1], weight.shape[0])
    return packed_linear(x, packed, bias)


def packed_rows(rows: int, dtype: torch.dtype) -> int:
    """How many rows a call of `rows` rows runs the prepacked copy at, 0 for F.linear (or,
    in float32 past one step, for float32_pieces): decode sizes and every bf16 count as they
    are; in float32 the bounded set of step sizes, and on a non-Intel AVX-512 CPU the counts
    up to 2,048 that the next step up covers within PACKED_PAD_MAX (padded to it)."""
    if rows <= 0:
        return 0
    if rows <= PACKED_MAX_ROWS or dtype == torch.bfloat16:
        return rows
    if rows > PACKED_STEP_MAX_ROWS or dtype != torch.float32:
        return 0
    step = -(-rows // PACKED_ROW_STEP) * PACKED_ROW_STEP
    if step == rows or (_float32_pads(dtype) and step <= PACKED_PAD_MAX * rows):
        return step
    return 0


def float32_pieces(rows: int) -> list[int]:
    """The row counts a float32 call of `rows` rows (past one step, and not taken whole by
    packed_rows) is cut into: 2,048 rows at a time, then the whole steps of the rest, then
    what is left (which packed_rows pads, or MKL takes). Each piece but the last is a step."""
    pieces = []
    while rows > PACKED_STEP_MAX_ROWS:
        pieces.append(PACKED_STEP_MAX_ROWS)
        rows -= PACKED_STEP_MAX_ROWS
    whole = rows // PACKED_ROW_STEP * PACKED_ROW_STEP
    if whole and whole != rows and not packed_rows(rows, torch.float32):
        pieces.append(whole)
        rows -= whole
    return pieces + ([rows] if rows else [])


@functools.cache
def _float32_pads(dtype: torch.dtype) -> bool:
    # MKL takes its AVX-512 code on Intel CPUs only (its dispatch reads the vendor): there
    # the steps cost nothing, but padding would be wasted rows, so only other vendors pad (a
    # CPU whose vendor is unknown does not).
    return (dtype == torch.float32 and "avx512_f" in native_lib.cpu_isa_flags()
            and native_lib.cpu_vendor() not in ("GenuineIntel", ""))


def describe_routes(dtype: torch.dtype) -> str:
    """Which GEMM serves which calls of prepacked projections in `dtype`, for the start-up log."""
    if dtype == torch.bfloat16:
        kernel, gemm_kernel = load_bf16_rows(), load_amx_gemm()
        gemm = ("" if gemm_kernel is None else
                f"amx_gemm.c ({gemm_kernel.form} form) over packed copies of its own up to {gemm_kernel.max_rows} "
                "rows, ")
        if kernel is not None and kernel.tile_form_ready():
            return (f"bf16 projections: bf16_rows.c's tile form (AMX) over the plain weights up to {TILE_MAX_ROWS} "
                    f"rows, {gemm}oneDNN packed copies above")
        if gemm:
            return f"bf16 projections: past the GGUF blocks' rows {gemm}oneDNN packed copies above"
        return "bf16 projections: oneDNN packed copies at every row count"
    f32 = load_f32_gemm()
    if f32 is not None:
        return (f"float32 projections: past the GGUF blocks' rows f32_gemm.c (AVX2, no AVX-512 here) over packed "
                f"copies of its own up to {f32.max_rows} rows, oneDNN packed copies and MKL above")
    steps = (f"float32 projections: oneDNN packed copies up to {PACKED_MAX_ROWS} rows and at {PACKED_ROW_STEP}-row "
             f"steps up to {PACKED_STEP_MAX_ROWS} (longer calls over weights of {PIECES_MIN_WEIGHT:,} elements and up "
             "cut into steps)")
    if not _float32_pads(dtype):
        return steps + ", MKL's sgemm for the rows past the last whole step"
    return (steps + f", other counts padded up to the next step within {PACKED_PAD_MAX}x: MKL's sgemm runs its "
            f"AVX2 code on this {native_lib.cpu_vendor()} AVX-512 CPU")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM over a prepacked weight (the only call that hands it a row count)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
