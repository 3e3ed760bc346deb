"""Compiled decoder segments, built off the request path and cached on disk.

The runner asks a `ForwardProvider` for the segments of a step with T tokens. Until the
compiled copy of T's bucket is ready it gets the eager ones, so a server is ready as fast
as without compilation; a background thread compiles each bucket (torch.compile /
inductor) and swaps it in when done.

Buckets: T = 1 (a batch-1 decode step: dynamo specializes size 1, so it is its own graph)
and T >= 2, one graph dynamic in the token dimension. Attention stays eager between the
segments (its Python loop over rows would otherwise recompile per batch layout), so a
forward runs num_layers + 1 compiled calls.

Inductor's own caches (FX graph + AOTAutograd) hold the artifacts. They live under the
user's cache dir in a folder keyed by model config, dtype, torch version and CPU flags:
weights are graph inputs, never constants, so the artifacts do not depend on their
values. A later start re-traces (a few seconds, still in the background) and loads the
compiled kernels from there instead of running the C++ compiler.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from prelude.executor.device import cpu_isa_flags
from prelude.model.layers.decoder_segments import DecoderSegments, between, first, last

logger = logging.getLogger("prelude.executor.compiled")

COMPILE_MODES = ("off", "background", "ahead")
_FORMAT = "1"  # bump when the segments' signatures change
BUCKETS = (1, 2)  # a bucket is named by its smallest token count


def bucket_of(num_tokens: int) -> int:
    return 1 if num_tokens <= 1 else 2


ForwardFn = Callable[..., torch.Tensor]  # Model.forward's signature


class ForwardProvider(Protocol):
    """What the runner asks for the forward of a step with `num_tokens` tokens."""

    def forward_for(self, num_tokens: int) -> ForwardFn: ...

    def close(self) -> None: ...


class EagerForwards:
    """No compilation: always the model's own forward."""

    def __init__(self, forward: ForwardFn) -> None:
        self._forward = forward

    def forward_for(self, num_tokens: int) -> ForwardFn:
        return self._forward

    def close(self) -> None:
        pass


def cache_key(model_config: object, dtype: torch.dtype, flags: frozenset[str] | None = None) -> str:
    """Folder name of a model's compiled artifacts."""
    parts = [_FORMAT, repr(model_config), str(dtype), torch.__version__,
             ",".join(sorted(cpu_isa_flags() if flags is None else flags))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


@dataclass
class CompileStatus:
    """What the background compile did, for logs, /metrics and tests."""

    ready: dict[int, float] = field(default_factory=dict)  # bucket -> seconds it took
    error: str | None = None
    started_s: float = field(default_factory=time.perf_counter)


class CompiledForwards:
    """Per-bucket compiled segments of one decoder, compiled by a background thread.

    `forward(..., segments=...)` is the decoder's forward; `run_example(T, segments)` runs
    one throwaway forward of T tokens with the given segments (the runner builds it on
    scratch KV), so this module knows nothing of attention metadata.
    """

    def __init__(
        self,
        forward: ForwardFn,
        model_config: object,
        dtype: torch.dtype,
        run_example: Callable[[int, DecoderSegments], None],
        cache_dir: Path,
    ) -> None:
        self._forward = forward
        self._run_example = run_example
        self.cache_dir = cache_dir / "compiled" / cache_key(model_config, dtype)
        self.status = CompileStatus()
        self._ready: dict[int, ForwardFn] = {}
        self._compiled = DecoderSegments(
            first=torch.compile(first, dynamic=None, fullgraph=True),
            between=torch.compile(between, dynamic=None, fullgraph=True),
            last=torch.compile(last, dynamic=None, fullgraph=True),
        )
        # The request thread runs only code compiled already: a guard miss there falls
        # back to running the segment eagerly instead of compiling on the request path.
        self._run_only = DecoderSegments(
            first=torch._dynamo.run(self._compiled.first),
            between=torch._dynamo.run(self._compiled.between),
            last=torch._dynamo.run(self._compiled.last),
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_all, name="prelude-compile", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every bucket is compiled (tests, eager-first); True when done."""
        if self._thread is not None:
            self._thread.join(timeout)
        return len(self._ready) == len(BUCKETS)

    def forward_for(self, num_tokens: int) -> ForwardFn:
        return self._ready.get(bucket_of(num_tokens), self._forward)

    def close(self) -> None:
        self._stop.set()

    def _compile_all(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # Inductor reads its cache location from the environment at each compile; the
        # artifacts live with Prelude's other caches (PRELUDE_CACHE_DIR moves them all).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        try:
            for bucket in (2, 1):  # prefill shapes first: they gain the most per call
                if self._stop.is_set():
                    return
                t0 = time.perf_counter()
                segments = self._compiled if bucket == 1 else _marking_dynamic(self._compiled)
                self._run_example(bucket_example_tokens(bucket), segments)
                # One dict item assignment (atomic under the GIL) swaps the bucket in.
                self._ready[bucket] = functools.partial(self._forward, segments=self._run_only)
                self.status.ready[bucket] = time.perf_counter() - t0
                logger.info("compiled forward for %s token(s) ready in %.1f s", "1" if bucket == 1 else ">=2",
                            self.status.ready[bucket])
        except Exception as exc:  # noqa: BLE001 - compile failures leave the eager path serving
            self.status.error = f"{type(exc).__name__}: {exc}"
            logger.warning("compilation failed, serving eagerly: %s", self.status.error)


def _marking_dynamic(compiled: DecoderSegments) -> DecoderSegments:
    """Segments that mark the token dimension of their activations dynamic before the
    compiled call, so the first compile of the >= 2 bucket yields one graph for every T."""

    def mark(*tensors: torch.Tensor) -> None:
        for t in tensors:
            torch._dynamo.mark_dynamic(t, 0)

    def first_(shape, h, w, cos, sin):  # noqa: ANN001, ANN202
        mark(h, cos, sin)
        return compiled.first(shape, h, w, cos, sin)

    def between_(shape, h, attn, post, pre, cos, sin):  # noqa: ANN001, ANN202
        mark(h, attn, cos, sin)
        return compiled.between(shape, h, attn, post, pre, cos, sin)

    def last_(shape, h, attn, post, norm):  # noqa: ANN001, ANN202
        mark(h, attn)
        return compiled.last(shape, h, attn, post, norm)

    return DecoderSegments(first=first_, between=between_, last=last_)


def bucket_example_tokens(bucket: int) -> int:
    """Token count of the example forward that compiles a bucket (>= 2: marked dynamic)."""
    return 1 if bucket == 1 else 16
