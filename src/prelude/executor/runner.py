"""ModelRunner.execute(ForwardBatch) -> BatchOutput: one path per execution class.

The runner owns everything that lives on the device: the model (built through the model
registry), its paged KV tensors, the attention backend and, on CUDA, the graphs (see
graphs.py: steps that fit a captured bucket are replayed, the rest run eagerly). A step's
integer inputs are packed on the host into one buffer (pinned on CUDA) and copied once,
non-blocking; the results come back in one copy (see `HostCopy`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from prelude.config import ExecutorConfig, LoraConfig
from prelude.executor.compiled import COMPILE_MODES, CompiledForwards, EagerForwards, ForwardProvider
from prelude.executor.device import resolve_attention_backend, resolve_device, resolve_dtype
from prelude.executor import label_heads
from prelude.executor.graphs import Capture, GraphConfig, GraphRunner
from prelude.executor.host_copy import HostCopy, HostValue
from prelude.executor.lora_slots import AdapterSlots
from prelude.executor.model_info import ModelInfo
from prelude.executor.model_registry import build_model
from prelude.executor.sampler import sample_deferred
from prelude.executor.step_threads import StepThreads, decoder_flops
from prelude.executor.vocab_mask import mask_padded_vocab
from prelude.forward_batch import (
    BatchOutput,
    BatchRow,
    DecodeBatch,
    ForwardBatch,
    HeadOutput,
    HeadSpec,
    MixedBatch,
    OneShotBatch,
    OneShotRow,
    SampleSpec,
)
from prelude.model import heads
from prelude.model.ggml_blocks import GgmlBlocks
from prelude.model.attention import get_attention_backend
from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillSlice, PrefillTensors
from prelude.model.base import KVCaches, Model
from prelude.model.cpu_fused_kernels import DTYPES as CPU_FUSED_DTYPES, load_cpu_kernels
from prelude.model.decoder_segments import DecoderSegments
from prelude.model.fused_segments import fused_segments, triton_segments
from prelude.model.loader import cache_root
from prelude.model.lora import LoraBatch, LoraStep
from prelude.params import LoraRequest, PoolingTask, TokenLogprob

logger = logging.getLogger("prelude.executor")


_ALIGN = 2  # int64 values: every view starts on a 16-byte boundary


def pack_int64(device: torch.device, *parts: Sequence[int]) -> list[torch.Tensor]:
    """Copy several int lists to the device in one transfer; returns one view per list.
    Each view starts 16-byte aligned: Triton specializes kernels on a pointer's 16-byte
    alignment, so an odd offset would compile another variant mid-request (~1 s on an H100)
    instead of reusing the one compiled for the graphs' static buffers."""
    sizes = [len(p) for p in parts]
    padded = [-(-n // _ALIGN) * _ALIGN for n in sizes]
    values: list[int] = []
    for p, n, width in zip(parts, sizes, padded):
        values.extend(p)
        values.extend([0] * (width - n))
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    return [view[:n] for view, n in zip(flat.split(padded), sizes)]


class LaunchedStep:
    """A step queued on the device; `wait` blocks until its one result copy has landed."""

    def __init__(self, build: Callable[[], BatchOutput]) -> None:
        self._build = build
        self._result: BatchOutput | None = None
        self.forward_done: float | None = None  # perf_counter when the forward was run (or queued)

    def wait(self) -> BatchOutput:
        if self._result is None:
            self._result = self._build()
        return self._result


@dataclass(frozen=True)
class StepInputs:
    """A forward's device inputs and where each row starts in the flattened batch."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    starts: list[int]
    token_type_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class _RowLayout:
    """Host-side description of one row before the single copy to the device."""

    ids: Sequence[int]
    positions: Sequence[int]
    slots: Sequence[int]  # -1: K/V not kept
    block_table: Sequence[int]
    context_len: int
    own_kv_in_cache: bool
    decode: bool
    segments: Sequence[int] | None = None  # per new token; None: one plain causal row


def fused_segments_for(model: Model, config: ExecutorConfig) -> DecoderSegments | None:
    """The fused segments (model/fused_segments.py) for a decoder: over the Triton kernels on
    CUDA, over the C kernels for float32 and bfloat16 on the CPU; None (the model's own eager
    segments) when turned off or where the kernels cannot run."""
    if not config.fused_kernels or model.is_encoder:
        return None
    head_dim = int(getattr(model.config, "head_dim", 0) or 0)
    if model.device.type == "cpu":
        if model.dtype not in CPU_FUSED_DTYPES or head_dim < 2 or head_dim % 2:
            return None
        kernels = load_cpu_kernels()
        return None if kernels is None else fused_segments(kernels, "cpu")
    if model.device.type != "cuda":
        return None
    if head_dim < 2 or head_dim & (head_dim - 1):  # the rotary kernel tiles a head in two power-of-two halves
        logger.info("head_dim %d is not a power of two: the decoder's elementwise ops run unfused", head_dim)
        return None
    try:
        return triton_segments()
    except ImportError:  # triton is optional
        logger.warning("triton is not installed: the decoder's elementwise ops run unfused")
        return None


def step_size(batch: ForwardBatch) -> tuple[int, int]:
    """(tokens computed, rows sampled) of a step."""
    paged = batch.rows if isinstance(batch, (DecodeBatch, MixedBatch)) else ()
    oneshot = batch.rows if isinstance(batch, OneShotBatch) else batch.oneshot_rows if isinstance(batch, MixedBatch) else ()
    tokens = sum(len(r.token_ids) for r in paged) + sum(len(r.token_ids) - r.num_cached for r in oneshot)
    sampled = sum(r.sample is not None for r in paged) + sum(r.sample is not None for r in oneshot)
    return tokens, sampled


class ModelRunner:
    """Owns the device, the model, its paged KV tensors and the attention backend;
    knows nothing of requests' lifecycles."""

    def __init__(self, model: Model, block_size: int, config: ExecutorConfig | None = None,
                 lora: LoraConfig | None = None) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.config = config or ExecutorConfig(device=str(model.device))
        self.kv_caches: KVCaches = []
        self._scratch_slot = 0
        self.graphs: GraphRunner | None = None
        self.emittable_vocab: int | None = None  # the tokenizer's table: head rows past it are never sampled
        cfg = model.config
        self.info = ModelInfo(
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            max_positions=model.max_positions,
            max_position_embeddings=int(cfg.max_position_embeddings),
            sliding_window=getattr(cfg, "sliding_window", None),
            kv_bytes_per_block=model.kv_bytes_per_block(block_size),
            labels=tuple(cfg.id2label),
            can_generate=model.can_generate,
            is_encoder=model.is_encoder,
            default_pooling=model.default_pooling,
            eos_token_ids=tuple(getattr(cfg, "eos_token_ids", ())),
            device=str(self.device),
            dtype=str(model.dtype).removeprefix("torch."),
        )
        self.forwards: ForwardProvider = self._forward_provider()
        # LoRA: resident adapter slots, and the forward that takes a LoraStep (the fused or
        # eager segments: compiled segments and captured graphs take plain weights only).
        self.adapters: AdapterSlots | None = None
        if lora is not None:
            if model.is_encoder:
                raise ValueError("LoRA adapters are for decoder models")
            self.adapters = AdapterSlots(cfg, lora, model.dtype, self.device)  # type: ignore[arg-type]
        segments = fused_segments_for(model, self.config)
        self._lora_forward = functools.partial(model.forward, segments=segments) if segments else model.forward
        self.step_threads = StepThreads(self.device, *decoder_flops(cfg))

    def _forward_provider(self) -> ForwardProvider:
        """Compiled segments where asked for and possible; the eager forward otherwise."""
        mode = self.config.compile
        if mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {mode!r}; use one of {', '.join(COMPILE_MODES)}")
        segments = fused_segments_for(self.model, self.config)
        eager = EagerForwards(functools.partial(self.model.forward, segments=segments) if segments else
                              self.model.forward)
        if mode == "off":
            return eager
        why_not = None
        if self.device.type != "cpu":
            why_not = "compiled segments are for the CPU (GPUs use CUDA graphs)"
        elif self.model.is_encoder:
            why_not = "encoders run eagerly"
        elif not getattr(self.model, "weights_are_plain", False):
            why_not = "the model was built with prepacked oneDNN weights (build it through ModelRunner.create)"
        if why_not:
            logger.info("--compile %s ignored: %s", mode, why_not)
            return eager
        compiled = CompiledForwards(self.model.forward, self.model.config, self.model.dtype, self._compile_example,
                                    cache_root())
        if mode == "ahead":
            compiled.start()
            compiled.wait()
        return compiled

    def start_background_work(self) -> None:
        """Called by the engine once it is built: background compilation starts only then,
        so it never competes with loading for the GIL and the cores (ready time unchanged)."""
        if isinstance(self.forwards, CompiledForwards):
            self.forwards.start()

    def _compile_example(self, num_tokens: int, segments: DecoderSegments) -> None:
        """A throwaway forward of a fresh `num_tokens`-token prompt on scratch KV (nothing
        is written or read there): the shapes a compile needs, none of the server's state."""
        scratch = self.model.allocate_kv_cache(1, self.block_size)
        lay = _RowLayout([0] * num_tokens, range(num_tokens), [-1] * num_tokens, (), num_tokens, False, decode=False)
        inputs = self._inputs([lay], write_kv=False)
        with torch.inference_mode():
            self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, scratch, segments=segments)

    @classmethod
    def create(
        cls,
        model_config: object,
        weights: dict[str, torch.Tensor],
        config: ExecutorConfig,
        block_size: int,
        max_positions: int | None = None,
        blocks: Mapping[str, GgmlBlocks] | None = None,
        lora: LoraConfig | None = None,
    ) -> "ModelRunner":
        """Build the model on the configured device from host weights (which the caller
        drops afterwards: no host copy of a GPU model is kept). `blocks`: a GGUF's
        block-format projections, which CPU decode reads where it can."""
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        attention = get_attention_backend(resolve_attention_backend(config.attention_backend, device), device)
        # Compiled segments take plain weights; eager CPU forwards run faster on prepacked ones.
        model = build_model(model_config, weights, dtype, device, attention, max_positions,  # type: ignore[arg-type]
                            prepack=config.compile == "off", blocks=blocks)
        return cls(model, block_size, config, lora)

    def limit_sampled_vocab(self, emittable: int) -> None:
        """Sample only ids below `emittable` (a padded head has rows no tokenizer can spell)."""
        self.emittable_vocab = emittable

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """`num_blocks` for the KV manager, plus one scratch block that no request owns:
        padding rows of a replayed graph write their K/V there."""
        self.kv_caches = self.model.allocate_kv_cache(num_blocks + 1, self.block_size)
        self._scratch_slot = num_blocks * self.block_size

    # --- KV hand-off (prefill/decode disaggregation): whole blocks, no request state ----

    @torch.inference_mode()
    def read_kv_blocks(self, blocks: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of the K/V of `blocks`, per layer ([len(blocks), block_size, heads,
        head_dim] each): what another runner's `write_kv_blocks` takes."""
        (index,) = pack_int64(self.device, blocks)
        return [(k.index_select(0, index).to("cpu"), v.index_select(0, index).to("cpu")) for k, v in self.kv_caches]

    @torch.inference_mode()
    def write_kv_blocks(self, blocks: Sequence[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy K/V read by `read_kv_blocks` (any runner of the same model) into `blocks`."""
        if len(kv) != len(self.kv_caches):
            raise ValueError(f"KV of {len(kv)} layers for a model of {len(self.kv_caches)}")
        (index,) = pack_int64(self.device, blocks)
        for (k, v), (src_k, src_v) in zip(self.kv_caches, kv):
            if src_k.shape[1:] != k.shape[1:] or src_k.shape[0] != len(blocks):
                raise ValueError(f"KV blocks of shape {tuple(src_k.shape)} do not fit {len(blocks)} x {tuple(k.shape[1:])}")
            k.index_copy_(0, index, src_k.to(device=k.device, dtype=k.dtype))
            v.index_copy_(0, index, src_v.to(device=v.device, dtype=v.dtype))

    def capture_graphs(self, max_model_len: int, capture: Capture | None = None,
                       config: GraphConfig | None = None) -> None:
        """Capture the bucketed forwards (CUDA, unless enforce_eager); `capture=EMULATE`
        builds the same buckets on any device (tests)."""
        if capture is None:
            if self.device.type != "cuda" or self.config.enforce_eager:
                return
            capture = Capture.CUDA
        if self.model.is_encoder or not self.kv_caches:
            return
        reads_row_tensors = getattr(self.model, "attention", None) is not None and \
            self.model.attention.name == "triton"  # type: ignore[attr-defined]
        config = config or GraphConfig(capture_prefill=reads_row_tensors)
        if config.capture_prefill and not reads_row_tensors:
            raise ValueError("prefill graphs need an attention backend that reads PrefillTensors (triton)")
        self.graphs = GraphRunner(
            lambda ids, pos, meta: self.forwards.forward_for(ids.shape[0])(ids, pos, meta, self.kv_caches),
            config, self.device, self.block_size,
            max_blocks_per_row=-(-max_model_len // self.block_size), scratch_slot=self._scratch_slot, capture=capture,
        )

    # --- inputs -------------------------------------------------------------------------

    def _inputs(self, layouts: list[_RowLayout], write_kv: bool) -> StepInputs:
        """Flatten rows into device inputs with one host-to-device copy."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[int] = []
        table_spans: list[tuple[int, int]] = []
        starts: list[int] = []
        dec_index: list[int] = []
        dec_lens: list[int] = []
        dec_tables: list[Sequence[int]] = []
        segmented = any(lay.segments is not None for lay in layouts)
        segments: list[int] = []
        for lay in layouts:
            start = len(ids)
            starts.append(start)
            ids.extend(lay.ids)
            positions.extend(lay.positions)
            slots.extend(lay.slots)
            if segmented:
                segments.extend(lay.segments if lay.segments is not None else [0] * len(lay.ids))
            if lay.decode:
                dec_index.append(start)
                dec_lens.append(lay.context_len)
                dec_tables.append(lay.block_table)
            else:
                table_spans.append((len(tables), len(lay.block_table)))
                tables.extend(lay.block_table)
        width = max((len(t) for t in dec_tables), default=0)
        padded = [b for t in dec_tables for b in (*t, *([0] * (width - len(t))))]
        kept = [i for i, s in enumerate(slots) if s >= 0]
        any_kept = write_kv and bool(kept)
        all_kept = len(kept) == len(slots)
        pre = [(start, lay) for lay, start in zip(layouts, starts) if not lay.decode]
        pre_width = max((len(lay.block_table) for _, lay in pre), default=0)
        pre_columns = ([start for start, _ in pre], [len(lay.ids) for _, lay in pre],
                       [lay.context_len for _, lay in pre], [int(lay.own_kv_in_cache) for _, lay in pre])
        pre_tables = [b for _, lay in pre for b in (*lay.block_table, *([0] * (pre_width - len(lay.block_table))))]
        (d_ids, d_pos, d_slots, d_tables, d_dec_index, d_dec_tables, d_dec_lens, d_kept, *d_pre, d_pre_tables,
         d_segments) = pack_int64(
            self.device, ids, positions, slots if any_kept else [], tables, dec_index, padded, dec_lens,
            kept if any_kept and not all_kept else [], *pre_columns, pre_tables, segments,
        )
        prefills = []
        span = iter(table_spans)
        for lay, start in zip(layouts, starts):
            if lay.decode:
                continue
            off, n = next(span)
            prefills.append(PrefillSlice(start, len(lay.ids), lay.context_len, d_tables[off : off + n],
                                         own_kv_in_cache=lay.own_kv_in_cache, segmented=lay.segments is not None))
        decodes = None
        if dec_index:
            decodes = DecodeRows(
                query_index=d_dec_index,
                block_tables=d_dec_tables.view(len(dec_index), width),
                context_lens=d_dec_lens,
                max_context_len=max(dec_lens),
            )
        prefill_tensors = None
        if pre:
            prefill_tensors = PrefillTensors(*d_pre, d_pre_tables.view(len(pre), pre_width),
                                             max_query_len=max(len(lay.ids) for _, lay in pre))
        meta = AttentionMetadata(
            slot_mapping=d_slots if any_kept else None,
            prefills=tuple(prefills),
            decodes=decodes,
            block_size=self.block_size,
            kept_tokens=None if all_kept or not any_kept else d_kept,
            prefill_tensors=prefill_tensors,
            segment_ids=d_segments if segmented else None,
        )
        return StepInputs(d_ids, d_pos, meta, starts)

    def _paged_layout(self, row: BatchRow) -> _RowLayout:
        bs = self.block_size
        n = len(row.token_ids)
        context_len = row.start_pos + n
        table = row.block_table
        slots = [table[p // bs] * bs + p % bs for p in range(row.start_pos, context_len)]
        nb = (context_len + bs - 1) // bs
        return _RowLayout(row.token_ids, range(row.start_pos, context_len), slots,
                          table if n == 1 else table[:nb], context_len, True, decode=n == 1)

    def _oneshot_layout(self, r: OneShotRow) -> _RowLayout:
        """A prompt suffix after its cached prefix; only the blocks it publishes are written."""
        bs = self.block_size
        n = len(r.token_ids)
        published_end = r.num_cached + len(r.publish_blocks) * bs
        slots = [r.publish_blocks[(p - r.num_cached) // bs] * bs + p % bs if p < published_end else -1
                 for p in range(r.num_cached, n)]
        table = (*r.prefix_blocks, *r.publish_blocks) if r.prefix_blocks else ()
        if not r.item_lens:
            return _RowLayout(r.token_ids[r.num_cached :], range(r.num_cached, n), slots, table, n, False, decode=False)
        # Packed items: each restarts at the shared part's end and is its own segment.
        shared = r.shared_len
        assert r.num_cached <= shared and published_end <= shared, "only the shared part is cached"
        positions = list(range(r.num_cached, shared))
        segments = [0] * (shared - r.num_cached)
        for i, length in enumerate(r.item_lens, start=1):
            positions.extend(range(shared, shared + length))
            segments.extend([i] * length)
        return _RowLayout(r.token_ids[r.num_cached :], positions, slots, table, n, False, decode=False,
                          segments=segments)

    def build_paged_inputs(self, rows: Sequence[BatchRow]) -> StepInputs:
        return self._inputs([self._paged_layout(r) for r in rows], write_kv=True)

    def build_fused_inputs(self, paged: Sequence[BatchRow], oneshot: Sequence[OneShotRow]) -> StepInputs:
        """Paged rows, then OneShot rows, in one forward: the paged rows write their K/V
        to their blocks, the OneShot rows only to the blocks they publish (if any)."""
        assert not self.model.is_encoder, "encoders keep no KV: they have no paged rows"
        layouts = [self._paged_layout(r) for r in paged] + [self._oneshot_layout(r) for r in oneshot]
        return self._inputs(layouts, write_kv=True)

    def build_oneshot_inputs(self, rows: Sequence[OneShotRow]) -> StepInputs:
        inputs = self._inputs([self._oneshot_layout(r) for r in rows], write_kv=True)
        if not self.model.is_encoder:
            return inputs
        types = [t for r in rows for t in (r.head.pooling.token_type_ids if r.head and r.head.pooling
                                           and r.head.pooling.token_type_ids else [0] * len(r.token_ids))]
        (d_types,) = pack_int64(self.device, types)
        return StepInputs(inputs.input_ids, inputs.positions, inputs.meta, inputs.starts, d_types)

    # --- forwards -----------------------------------------------------------------------

    def forward(self, inputs: StepInputs, lora: LoraStep | None = None) -> torch.Tensor:
        if lora is not None:
            return self._lora_forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, lora=lora)
        # Captured graphs take no segment ids: multi-item rows always run eagerly.
        if self.graphs is not None and inputs.token_type_ids is None and inputs.meta.segment_ids is None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            if hidden is not None:
                return hidden
        forward = self.forwards.forward_for(inputs.input_ids.shape[0])
        return forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, inputs.token_type_ids)

    def forward_rows(self, rows: tuple[BatchRow, ...]) -> tuple[torch.Tensor, list[int]]:
        """Run the trunk on paged rows; returns hidden states [T, H] and each row's start."""
        inputs = self.build_paged_inputs(rows)
        return self.forward(inputs, self.lora_step([(r.lora, len(r.token_ids)) for r in rows])), inputs.starts

    def forward_oneshot(self, rows: Sequence[OneShotRow]) -> tuple[torch.Tensor, list[int]]:
        """Flattened varlen prompt suffixes. A row attends to its cached prefix blocks and
        to its own K/V, which are temporaries except the full blocks it publishes."""
        inputs = self.build_oneshot_inputs(rows)
        lora = self.lora_step([(r.lora, len(r.token_ids) - r.num_cached) for r in rows])
        return self.forward(inputs, lora), inputs.starts

    def lora_step(self, rows: Sequence[tuple[LoraRequest | None, int]]) -> LoraStep | None:
        """The adapters of a step's rows (each row's adapter and computed token count, in
        the forward's row order), loaded into slots; None when every row is the base."""
        if all(lora is None for lora, _ in rows):
            return None
        if self.adapters is None:
            raise ValueError("a row names a LoRA adapter but LoRA is off (no --max-loras slots)")
        slots = self.adapters.slots_for([lora for lora, _ in rows])
        batch = LoraBatch.build(slots, [n for _, n in rows], self.device)
        return None if batch is None else LoraStep(self.adapters.slots, batch)

    # --- one entry point, one path per class ------------------------------------------

    @torch.inference_mode()
    def launch(self, batch: ForwardBatch) -> "LaunchedStep":
        """Queue the forward, sampling, heads and the one result copy; on CUDA this returns
        while the device still works, so the host can schedule the next step meanwhile.
        A CPU step too small to split runs on one thread (step_threads.py)."""
        with self.step_threads.for_step(*step_size(batch)):
            return self._launch(batch)

    def _launch(self, batch: ForwardBatch) -> "LaunchedStep":
        if isinstance(batch, OneShotBatch):
            hidden, starts = self.forward_oneshot(batch.rows)
            # Heads see the computed suffix only (prefix-hit rows never need earlier rows).
            rows = [(r.request_id, r.token_ids[r.num_cached :], r.sample, r.head) for r in batch.rows]
        elif isinstance(batch, MixedBatch) and batch.oneshot_rows:  # a fused step
            inputs = self.build_fused_inputs(batch.rows, batch.oneshot_rows)
            lora = self.lora_step([(r.lora, len(r.token_ids)) for r in batch.rows]
                                  + [(r.lora, len(r.token_ids) - r.num_cached) for r in batch.oneshot_rows])
            hidden, starts = self.forward(inputs, lora), inputs.starts
            rows = [(r.request_id, r.token_ids, r.sample, r.head) for r in batch.rows]
            rows += [(r.request_id, r.token_ids[r.num_cached :], r.sample, r.head) for r in batch.oneshot_rows]
        else:
            assert isinstance(batch, (DecodeBatch, MixedBatch))
            hidden, starts = self.forward_rows(batch.rows)
            rows = [(r.request_id, r.token_ids, r.sample, r.head) for r in batch.rows]
        forward_done = time.perf_counter()
        launched = self._outputs(hidden, starts, rows)
        launched.forward_done = forward_done
        return launched

    def execute(self, batch: ForwardBatch) -> BatchOutput:
        return self.launch(batch).wait()

    def _outputs(
        self,
        hidden: torch.Tensor,
        starts: list[int],
        rows: list[tuple[str, list[int], SampleSpec | None, HeadSpec | None]],
    ) -> "LaunchedStep":
        """Project only what each row asked for: last-token logits, prompt logprobs, heads."""
        copy = HostCopy()
        want = [(rid, starts[i] + len(tok) - 1, spec) for i, (rid, tok, spec, _) in enumerate(rows) if spec is not None]
        sampled_build = None
        if want:
            (index,) = pack_int64(self.device, [idx for _, idx, _ in want])
            logits = mask_padded_vocab(self.model.compute_logits(hidden.index_select(0, index)), self.emittable_vocab)
            sampled_build = sample_deferred(logits, [s for _, _, s in want], copy)
        pending = {rid: self._head(hidden[starts[i] : starts[i] + len(tokens)], tokens, head, copy)
                   for i, (rid, tokens, _, head) in enumerate(rows) if head is not None}
        copy.start()

        def build() -> BatchOutput:
            sampled = dict(zip([rid for rid, _, _ in want], sampled_build())) if sampled_build else {}
            return BatchOutput(sampled=sampled, heads={rid: b() for rid, b in pending.items()})

        return LaunchedStep(build)

    def _head(self, hidden: torch.Tensor, tokens: list[int], head: HeadSpec, copy: HostCopy):  # noqa: ANN202
        """Queue a row's head tensors on `copy`; returns a builder run after the copy."""
        prompt: tuple[HostValue, HostValue, HostValue | None, HostValue | None] | None = None
        if head.prompt_logprobs is not None and len(tokens) > 1:
            actual, rank, vals, ids = heads.prompt_token_logprobs(
                self.model.compute_logits, hidden[:-1], tokens, head.prompt_logprobs
            )
            prompt = (copy.add(actual), copy.add(rank), copy.add(vals) if vals is not None else None,
                      copy.add(ids) if ids is not None else None)
        p = head.pooling
        scores: HostValue | None = None
        embedding: HostValue | None = None
        if p is not None and p.task is PoolingTask.LABELS:
            rows_at, label_ids = pack_int64(self.device, label_heads.score_rows(len(tokens), p), p.label_token_ids)
            scores = copy.add(label_heads.label_scores(
                hidden.index_select(0, rows_at), label_ids, p.label_softmax,
                self.model.compute_logits, self.model.compute_label_logits,
            ).reshape(-1))
        elif p is not None and p.task is PoolingTask.SEQUENCE_LOGPROBS:
            predictors, targets = label_heads.sequence_rows(tokens, p.item_lens)
            rows_at, d_targets = pack_int64(self.device, predictors, targets)
            scores = copy.add(label_heads.sequence_logprobs(
                hidden.index_select(0, rows_at), d_targets, p.item_lens, self.model.compute_logits))
        elif p is not None and p.task is PoolingTask.CLASSIFY:
            scores = copy.add(self.model.classify(hidden))
        elif p is not None:
            pooled = heads.pool(hidden, p.pooling or self.model.default_pooling)
            embedding = copy.add(heads.normalize(pooled) if p.normalize else pooled)

        def build() -> HeadOutput:
            prompt_lps: list[TokenLogprob | None] | None = None
            if head.prompt_logprobs is not None:
                prompt_lps = [None]
                if prompt is not None:
                    actual, rank, vals, ids = (v.get() if v is not None else None for v in prompt)
                    for j, lp in enumerate(actual):  # type: ignore[arg-type]
                        top = () if ids is None else tuple((int(i), v) for i, v in zip(ids[j], vals[j]))  # type: ignore[index]
                        prompt_lps.append(TokenLogprob(tokens[j + 1], lp, top, int(rank[j])))  # type: ignore[index]
            return HeadOutput(
                prompt_logprobs=prompt_lps,
                scores=scores.get() if scores is not None else None,
                embedding=embedding.get() if embedding is not None else None,
            )

        return build
