"""Static-shape replay of the trunk's forward: CUDA graphs captured at bucketed sizes.

- Decode steps are captured at batch-size buckets (every attention backend: the decode
  path reads a fixed number of blocks per row and masks by context length).
- OneShot rows and short prompt chunks are captured at token-count buckets with up to
  `max_rows` rows (Triton backend only: the torch backend loops over rows in Python).
  These are the shapes LAPS' adaptive wait-depth batching aims for.

A step that fits a bucket is copied into that bucket's static buffers (device-to-device,
padding rows write to a scratch KV block that no request owns) and replayed; anything
larger, or mixed, runs eagerly. `Capture.EMULATE` replays by calling the forward on the
static buffers, which runs on a CPU: tests check the padding logic there.

With `adapter_index` (LoRA slots exist), every bucket also holds a static per-token
adapter slot index (-1: the base, also for padding rows), the forward's fourth input: the
LoRA kernels read it on the device, so one captured graph serves any mix of adapters.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillTensors

logger = logging.getLogger("prelude.executor")

# (ids, positions, meta, per-token adapter slots or None) -> hidden states
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, "torch.Tensor | None"], torch.Tensor]


class Capture(enum.Enum):
    CUDA = "cuda"  # torch.cuda.CUDAGraph
    EMULATE = "emulate"  # call the forward on the static buffers (any device; tests)


@dataclass(frozen=True)
class GraphConfig:
    decode_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    prefill_token_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    max_prefill_rows: int = 16
    capture_prefill: bool = True  # needs a backend that reads PrefillTensors (triton)


class _Replay:
    """One captured bucket: static inputs, the captured forward and its static output."""

    def __init__(self, forward: Forward, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 capture: Capture, pool: object | None, adapter_index: bool = False) -> None:
        self.ids, self.positions, self.meta = ids, positions, meta
        self.adapter_slots = torch.full_like(ids, -1) if adapter_index else None
        self._forward = lambda i, p, m: forward(i, p, m, self.adapter_slots)
        self._capture = capture
        self._graph: torch.cuda.CUDAGraph | None = None
        if capture is Capture.CUDA:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up (allocator, autotuning) off the graph
                self._forward(ids, positions, meta)
            torch.cuda.current_stream().wait_stream(stream)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph, pool=pool):
                self.out = self._forward(ids, positions, meta)
        else:
            self.out = self._forward(ids, positions, meta)

    @property
    def pool(self) -> object | None:
        return self._graph.pool() if self._graph is not None else None

    def replay(self) -> torch.Tensor:
        if self._graph is not None:
            self._graph.replay()
        else:
            self.out = self._forward(self.ids, self.positions, self.meta)
        return self.out


class GraphRunner:
    """Buckets of replayable forwards over one model's KV caches."""

    def __init__(self, forward: Forward, config: GraphConfig, device: torch.device, block_size: int,
                 max_blocks_per_row: int, scratch_slot: int, capture: Capture, adapter_index: bool = False,
                 window_scratch_slot: int | None = None) -> None:
        """`window_scratch_slot`: a model whose sliding layers keep their K/V in a pool of their
        own (AttentionMetadata.window): that pool's scratch slot, and every bucket holds static
        window tables and slots beside the global ones."""
        self.config = config
        self.window_scratch_slot = window_scratch_slot
        self.adapter_index = adapter_index
        self.device = device
        self.block_size = block_size
        self.max_blocks = max_blocks_per_row
        self.scratch_slot = scratch_slot  # a KV slot no request owns: padding rows write there
        self._decode: dict[int, _Replay] = {}
        self._prefill: dict[int, _Replay] = {}
        t0 = time.perf_counter()
        pool = None
        for b in sorted(config.decode_batch_sizes, reverse=True):  # largest first: the pool fits all
            self._decode[b] = r = _Replay(forward, *self._decode_buffers(b), capture, pool, adapter_index)
            pool = pool or r.pool
        if config.capture_prefill:
            for n in sorted(config.prefill_token_sizes, reverse=True):
                self._prefill[n] = r = _Replay(forward, *self._prefill_buffers(n), capture, pool, adapter_index)
                pool = pool or r.pool
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d decode and %d prefill graphs (%s) in %.2f s", len(self._decode), len(self._prefill),
                    capture.value, self.capture_seconds)

    @property
    def decode_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._decode))

    @property
    def prefill_token_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._prefill))

    # --- static buffers ------------------------------------------------------------------

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.long, device=self.device)

    def _decode_buffers(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        rows = DecodeRows(
            query_index=torch.arange(b, device=self.device),
            block_tables=self._zeros(b, self.max_blocks),
            context_lens=torch.ones(b, dtype=torch.long, device=self.device),
            max_context_len=self.max_blocks * self.block_size, max_is_a_row_len=False,
        )
        slots = torch.full((b,), self.scratch_slot, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slot_mapping=slots, prefills=(), decodes=rows, block_size=self.block_size)
        if self.window_scratch_slot is not None:  # the same rows over the window pool: tables and slots apart
            window_slots = torch.full((b,), self.window_scratch_slot, dtype=torch.long, device=self.device)
            meta = replace(meta, window=replace(meta, slot_mapping=window_slots, decodes=replace(
                rows, block_tables=self._zeros(b, self.max_blocks))))
        return self._zeros(b), self._zeros(b), meta

    def _prefill_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        r = self.config.max_prefill_rows
        tensors = PrefillTensors(
            query_start=self._zeros(r), query_lens=self._zeros(r), context_lens=self._zeros(r),
            own_kv_in_cache=self._zeros(r), block_tables=self._zeros(r, self.max_blocks), max_query_len=n,
        )
        slots = torch.full((n,), -1, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(slot_mapping=slots, prefills=(), decodes=None, block_size=self.block_size,
                                 prefill_tensors=tensors)
        if self.window_scratch_slot is not None:
            window_slots = torch.full((n,), -1, dtype=torch.long, device=self.device)
            meta = replace(meta, window=replace(meta, slot_mapping=window_slots, prefill_tensors=replace(
                tensors, block_tables=self._zeros(r, self.max_blocks))))
        return self._zeros(n), self._zeros(n), meta

    # --- replay ----------------------------------------------------------------------------

    def _pick(self, sizes: dict[int, _Replay], n: int) -> _Replay | None:
        fits = [s for s in sizes if s >= n]
        return sizes[min(fits)] if fits else None

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            adapter_slots: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hidden states [T, H] from a replayed bucket, or None when no bucket fits (or the
        step has adapters and the graphs were captured without an adapter index)."""
        t = ids.shape[0]
        if adapter_slots is not None and not self.adapter_index:
            return None
        if (meta.window is None) != (self.window_scratch_slot is None):
            return None  # the buckets' window buffers and the step's window metadata go together
        if meta.decodes is not None and not meta.prefills and meta.prefill_tensors is None:
            replay = self._pick(self._decode, t)
            if replay is None or meta.slot_mapping is None or meta.kept_tokens is not None:
                return None
            self._fill_decode(replay, ids, positions, meta)
        elif meta.decodes is None and meta.prefill_tensors is not None and self._prefill:
            rows = meta.prefill_tensors.query_lens.shape[0]
            replay = self._pick(self._prefill, t)
            if replay is None or rows > self.config.max_prefill_rows:
                return None
            self._fill_prefill(replay, ids, positions, meta)
        else:
            return None
        if replay.adapter_slots is not None:
            replay.adapter_slots.fill_(-1)
            if adapter_slots is not None:
                replay.adapter_slots[:t].copy_(adapter_slots)
        return replay.replay()[:t]

    def _fill_tokens(self, replay: _Replay, ids: torch.Tensor, positions: torch.Tensor) -> None:
        t = ids.shape[0]
        replay.ids[:t].copy_(ids)
        replay.ids[t:].zero_()
        replay.positions[:t].copy_(positions)
        replay.positions[t:].zero_()

    def _fill_decode(self, replay: _Replay, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        b = ids.shape[0]
        src, dst = meta.decodes, replay.meta.decodes
        assert src is not None and dst is not None and meta.slot_mapping is not None
        self._fill_tokens(replay, ids, positions)
        w = src.block_tables.shape[1]
        dst.block_tables.zero_()
        dst.block_tables[:b, :w].copy_(src.block_tables)
        dst.context_lens.fill_(1)
        dst.context_lens[:b].copy_(src.context_lens)
        slots = replay.meta.slot_mapping
        assert slots is not None
        slots.fill_(self.scratch_slot)
        slots[:b].copy_(meta.slot_mapping)
        if meta.window is not None and replay.meta.window is not None:  # the window pool's tables and slots
            wsrc, wdst = meta.window.decodes, replay.meta.window.decodes
            wslots = replay.meta.window.slot_mapping
            assert wsrc is not None and wdst is not None and wslots is not None and meta.window.slot_mapping is not None
            wdst.block_tables.zero_()
            wdst.block_tables[:b, : wsrc.block_tables.shape[1]].copy_(wsrc.block_tables)
            wslots.fill_(self.window_scratch_slot)
            wslots[:b].copy_(meta.window.slot_mapping)

    def _fill_prefill(self, replay: _Replay, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        src, dst = meta.prefill_tensors, replay.meta.prefill_tensors
        assert src is not None and dst is not None
        t, r = ids.shape[0], src.query_lens.shape[0]
        self._fill_tokens(replay, ids, positions)
        for name in ("query_start", "query_lens", "context_lens", "own_kv_in_cache"):
            d = getattr(dst, name)
            d.zero_()  # padding rows: no queries, no context
            d[:r].copy_(getattr(src, name))
        w = src.block_tables.shape[1]
        dst.block_tables.zero_()
        dst.block_tables[:r, :w].copy_(src.block_tables)
        slots = replay.meta.slot_mapping
        assert slots is not None
        slots.fill_(-1)
        if meta.slot_mapping is not None:
            slots[:t].copy_(meta.slot_mapping)
        if meta.window is not None and replay.meta.window is not None:  # the window pool's tables and slots
            wsrc, wdst = meta.window.prefill_tensors, replay.meta.window.prefill_tensors
            wslots = replay.meta.window.slot_mapping
            assert wsrc is not None and wdst is not None and wslots is not None
            wdst.block_tables.zero_()
            wdst.block_tables[:r, : wsrc.block_tables.shape[1]].copy_(wsrc.block_tables)
            wslots.fill_(-1)
            if meta.window.slot_mapping is not None:
                wslots[:t].copy_(meta.window.slot_mapping)
