"""Which decode GEMM route serves how many rows, measured on this CPU, once.

A GGUF model's projections can be read two ways in decode: from their stored blocks
(kernels/cpu/quant_gemm.py: far fewer bytes, but work that grows with every row) or dense
(linear.dense_linear: the oneDNN-prepacked copy, or in bf16 on an AMX CPU up to 32 rows
the tile form of bf16_rows.c over the plain weight, and the GEMM of our own over its packed
copy where it serves: amx_gemm.c in bf16, f32_gemm.c in float32 on a CPU without AVX-512;
more bytes, amortized over rows). The
crossover depends on the CPU (AVX2 vs AVX-512, AVX512-BF16, memory bandwidth) and the
dtype, so it is measured, not assumed: the model's own projections, every layer (decode
streams the weights from memory, as a step does), at 1, 2, 4, ... 16 rows until the blocks
lose (their cost grows with rows, the dense route's barely), both routes alternated.
Timed as the calling thread's CPU time with one torch thread, best of a few rounds: a
wall clock on a shared machine measures the other tenants, and both routes spread over
threads the same way (by output feature), so one thread's ratio is the team's. The answer
is cached per CPU, dtype, model shapes and kernel sources, so only a machine's first start
with a model pays for the measure; later starts read a small JSON file. The start-up log
states the choice; the per-row figures behind it are logged at debug level.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from prelude.cache_dirs import cache_root
from prelude.kernels.cpu import native_lib
from prelude.kernels.cpu.amx_gemm import AmxGemm
from prelude.kernels.cpu.f32_gemm import F32Gemm
from prelude.kernels.cpu.bf16_rows import Bf16Rows
from prelude.kernels.cpu.quant_gemm import QuantKernel
from prelude.kernels.ggml_quants import GgmlQuants
from prelude.model.layers.linear import dense_linear, own_gemm_kernel, tile_rows_kernel

logger = logging.getLogger("prelude.model.fast_paths.decode_routes")

ROW_COUNTS = (1, 2, 4, 8, 16)
_ROUNDS = 5
# paths under the prelude package
_SOURCES = ("kernels/cpu/quant_gemm.c", "kernels/cpu/bf16_rows.c", "kernels/cpu/amx_gemm.c", "kernels/cpu/f32_gemm.c",
            "model/fast_paths/decode_routes.py")


@dataclass(frozen=True)
class RouteChoice:
    """GGUF blocks for calls of at most `blocks_max_rows` rows (0: never), the dense
    prepacked route above; `ms` per row count: (blocks, dense) per decode step's
    projections; `source`: measured now, or read from the cache."""

    blocks_max_rows: int
    ms: dict[int, tuple[float, float]]
    source: str

    def describe(self, dtype: torch.dtype, what: str = "every projection") -> str:
        """The choice in one line, for the start-up log."""
        name = str(dtype).removeprefix("torch.")
        rule = ("the dense route for every row count" if self.blocks_max_rows == 0 else
                f"GGUF blocks for <= {self.blocks_max_rows} rows, the dense route above")
        return f"decode GEMMs in {name}, {what}: {rule} ({self.source} on this CPU)"

    def figures(self) -> str:
        """The per-row timings behind the choice, for the debug log."""
        rows = ", ".join(f"{r} rows {b:.1f} vs {d:.1f} ms" for r, (b, d) in sorted(self.ms.items()))
        return f"blocks vs dense (the projections' routes past the blocks) CPU time per step: {rows}"


def crossover(ms: dict[int, tuple[float, float]]) -> int:
    """The largest row count up to which the blocks were faster at every measured count."""
    best = 0
    for rows in sorted(ms):
        blocks, dense = ms[rows]
        if blocks >= dense:
            break
        best = rows
    return best


def _cache_file(pairs: Sequence[tuple[torch.Tensor, GgmlQuants]], dtype: torch.dtype) -> Path:
    here = Path(__file__).resolve().parents[2]  # the prelude package
    key = [str(dtype), torch.__version__, ",".join(sorted(native_lib.cpu_isa_flags())),
           str(torch.get_num_threads())]
    key += [f"{tuple(w.shape)}:{b.kind}" for w, b in pairs]
    key += [native_lib.source_text(here / s) for s in _SOURCES]
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"decode-routes-{digest}.json"


def _time_rows(pairs: Sequence[tuple[torch.Tensor, GgmlQuants]], packed: Sequence[torch.Tensor],
               tiles: Sequence[Bf16Rows | None], gemms: Sequence[tuple[AmxGemm | F32Gemm, torch.Tensor] | None],
               kernel: QuantKernel, dtype: torch.dtype, rows: int) -> tuple[float, float]:
    """(blocks, dense) ms of CPU time for one call of every projection at `rows` rows."""
    xs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w, _ in pairs}}

    def blocks() -> None:
        for w, b in pairs:
            kernel.linear(xs[w.shape[1]], b)

    def dense() -> None:
        for (w, _), p, t, g in zip(pairs, packed, tiles, gemms):
            dense_linear(xs[w.shape[1]], w, p, t, None, *(g or (None, None)))

    times: dict[str, list[float]] = {"blocks": [], "dense": []}
    blocks(), dense()  # first calls: oneDNN builds its kernel for this row count
    for i in range(_ROUNDS):
        for name, fn in (("blocks", blocks), ("dense", dense))[:: 1 if i % 2 == 0 else -1]:
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    return 1000 * min(times["blocks"]), 1000 * min(times["dense"])


def _measure(pairs: Sequence[tuple[torch.Tensor, GgmlQuants]], kernel: QuantKernel, dtype: torch.dtype,
             gemm_copies: Sequence[Callable[[], torch.Tensor | None]] | None) -> dict[int, tuple[float, float]]:
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w, _ in pairs]
    tiles = [tile_rows_kernel(w) for w, _ in pairs]  # what each projection's dense calls take
    gemms: list[tuple[AmxGemm | F32Gemm, torch.Tensor] | None] = []
    for i, (w, _) in enumerate(pairs):
        gemm = own_gemm_kernel(w)
        if gemm is None:
            gemms.append(None)
            continue
        # the projection's own copy where the caller has one (made now if not yet), else one for the measure
        copy = gemm_copies[i]() if gemm_copies is not None else gemm.pack(w)
        gemms.append(None if copy is None else (gemm, copy))
    ms: dict[int, tuple[float, float]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for rows in ROW_COUNTS:
                ms[rows] = _time_rows(pairs, packed, tiles, gemms, kernel, dtype, rows)
                if ms[rows][0] >= ms[rows][1]:
                    break  # more rows only add to the blocks' work
    finally:
        torch.set_num_threads(threads)
    return ms


def choose(pairs: Sequence[tuple[torch.Tensor, GgmlQuants]], kernel: QuantKernel, dtype: torch.dtype,
           gemm_copies: Sequence[Callable[[], torch.Tensor | None]] | None = None) -> RouteChoice:
    """The row counts the blocks serve, for the projections `pairs` (dense weight in
    `dtype`, its blocks): from the cache, else measured now and cached. `gemm_copies`: per
    pair, what gives its projection's copy for the GEMM of our own (amx_gemm.c's or
    f32_gemm.c's; None where none serves), so a measure makes no copy of its own."""
    path = _cache_file(pairs, dtype)
    try:
        data = json.loads(path.read_text())
        ms = {int(r): (float(b), float(d)) for r, (b, d) in data["ms"].items()}
        cached = RouteChoice(int(data["blocks_max_rows"]), ms, "cached")
        logger.debug("decode routes of %d projection(s) in %s (cached): %s", len(pairs),
                     str(dtype).removeprefix("torch."), cached.figures())
        return cached
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ms = _measure(pairs, kernel, dtype, gemm_copies)
    choice = RouteChoice(crossover(ms), ms, "measured")
    logger.debug("decode routes of %d projection(s) in %s (measured): %s", len(pairs),
                 str(dtype).removeprefix("torch."), choice.figures())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**asdict(choice), "source": "measured"}))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: measured again next start
        logger.warning("could not cache the decode route choice: %s", exc)
    return choice
