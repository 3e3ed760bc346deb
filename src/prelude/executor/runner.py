"""ModelRunner.launch(ForwardBatch) -> LaunchedStep; `.wait()` -> BatchOutput. One path
per batch type.

The runner owns everything that lives on the device: the model (built through the model
registry), its paged KV tensors, the attention backend and, on CUDA, the graphs (see
graphs.py: steps that fit a captured bucket are replayed, the rest run eagerly). A step's
integer inputs are flattened into one host-to-device copy (inputs.py); its outputs are
projected only where rows asked and come back in one copy (outputs.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from prelude.config import ExecutorConfig, LoraConfig, Populate
from prelude.executor.compiled import COMPILE_MODES, CompiledForwards, EagerForwards, ForwardProvider
from prelude.executor.device import (
    cpu_isa_flags,
    dtype_reason,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from prelude.executor.graphs import Capture, GraphConfig, GraphRunner
from prelude.executor.host_memory import keep_freed_activations
from prelude.executor.inputs import InputBuilder, RowLayout, StepInputs, copy_int64
from prelude.executor.kv_sizing import GRAPH_RESERVE_BYTES, DeviceMemory
from prelude.executor.lora_slots import AdapterSlots
from prelude.executor.model_info import ModelInfo
from prelude.model.registry import build_model
from prelude.executor.outputs import CarriedTokens, LaunchedStep, OutputHeads
from prelude.executor.read_rows import StepReads, row_read, step_reads
from prelude.executor.step_threads import StepThreads, decoder_flops
from prelude.forward_batch import (BatchRow, DecodeBatch, ForwardBatch, HeadSpec, MixedBatch, OneShotBatch,
                                  OneShotRow, SampleSpec)
from prelude.kernels.ggml_quants import GgmlQuants
from prelude.model.layers.linear import bound_onednn_caches
from prelude.model.attention import get_attention_backend
from prelude.model.attention.metadata import AttentionMetadata
from prelude.model.base import KVCaches, Model
from prelude.kernels.cpu.cpu_fused import DTYPES as CPU_FUSED_DTYPES, load_cpu_kernels
from prelude.model.layers.decoder_segments import DecoderSegments
from prelude.model.layers.fused_segments import fused_segments, triton_segments
from prelude.cache_dirs import cache_root
from prelude.model.loading.files import prepared_dir
from prelude.kernels.cpu.native_lib import ISA_CAP_ENV, isa_capped_to_avx2
from prelude.model.layers.pooler import Pooler
from prelude.model.lora.adapters import LoraBatch, LoraStep
from prelude.model.sentence_modules import SentenceModules
from prelude.model.loading.prepared import PreparedTensors
from prelude.params import EmbedSetup, LoraRequest

logger = logging.getLogger("prelude.executor")


def _unlike_llama(model: Model) -> str | None:
    """What differs from the Llama layer in a decoder's description (None: nothing, or no
    description)."""
    spec = getattr(model, "spec", None)
    return spec.is_plain_llama() if spec is not None else None


def fused_segments_for(model: Model, config: ExecutorConfig) -> DecoderSegments | None:
    """The fused segments (model/layers/fused_segments.py) for a decoder: over the Triton kernels on
    CUDA, over the C kernels for float32 and bfloat16 on the CPU; None (the model's own eager
    segments) when turned off or where the kernels cannot run."""
    if not config.fused_kernels or model.is_encoder:
        return None
    unlike = _unlike_llama(model)
    if unlike is not None:
        logger.info("elementwise ops: eager (the fused kernels compute the Llama layer; this model has %s)", unlike)
        return None
    head_dim = int(getattr(model.config, "head_dim", 0) or 0)
    if model.device.type == "cpu":
        if model.dtype not in CPU_FUSED_DTYPES or head_dim < 2 or head_dim % 2:
            return None
        kernels = load_cpu_kernels()
        if kernels is None:
            return None
        isa = "AVX-512" if "avx512_f" in cpu_isa_flags() else "AVX2"
        logger.info("elementwise ops: fused C kernels in %s (%s build for this CPU)",
                    str(model.dtype).removeprefix("torch."), isa)
        return fused_segments(kernels, "cpu")
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


def embed_setup(sentence: SentenceModules | None, hidden_size: int,
                matryoshka: tuple[int, ...] | None) -> EmbedSetup:
    """What the fronts need of a model's embeddings. Without a sentence-transformers folder:
    the hidden state, normalized unless a request says otherwise."""
    if sentence is None:
        return EmbedSetup(hidden_size, matryoshka=matryoshka)
    return EmbedSetup(sentence.dimension(hidden_size), sentence.prompts, sentence.default_prompt_name,
                      sentence.include_prompt, sentence.normalize, matryoshka)


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
                 lora: LoraConfig | None = None, sentence: SentenceModules | None = None,
                 matryoshka: tuple[int, ...] | None = None, score_template: str | None = None) -> None:
        """`sentence`: the checkpoint's sentence-transformers modules (pooling, Dense layers,
        Normalize, prompts); `matryoshka`: the sizes its config declares vectors may be cut
        to (model/sentence_modules.py); `score_template`: a token reranker's prompt template
        (model/loading/token_scorer.py)."""
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.config = config or ExecutorConfig(device=str(model.device))
        self.kv_caches: KVCaches = []
        self._scratch_slot = 0
        self.graphs: GraphRunner | None = None
        self.emittable_vocab: int | None = None  # the tokenizer's table: head rows past it are never sampled
        state_bytes = getattr(model, "state_bytes_per_slot", None)
        self.state_bytes_per_slot = int(state_bytes()) if state_bytes is not None else 0
        self.num_state_slots = 0
        self.inputs = InputBuilder(self.device, block_size, model.is_encoder, recurrent=self.state_bytes_per_slot > 0)
        cfg = model.config
        default_pooling = sentence.pooling if sentence is not None else model.default_pooling
        self.outputs = OutputHeads(model, Pooler(sentence.dense if sentence else (), model.device), default_pooling)
        self.info = ModelInfo(
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            max_positions=model.max_positions,
            # a sentence-transformers folder's max_seq_length bounds its inputs (as vLLM reads it)
            max_position_embeddings=min(int(cfg.max_position_embeddings),
                                        (sentence.max_seq_length if sentence else None) or int(cfg.max_position_embeddings)),
            sliding_window=getattr(cfg, "sliding_window", None),
            kv_bytes_per_block=model.kv_bytes_per_block(block_size),
            labels=tuple(cfg.id2label),
            can_generate=model.can_generate,
            is_encoder=model.is_encoder,
            default_pooling=default_pooling,
            eos_token_ids=tuple(getattr(cfg, "eos_token_ids", ())),
            device=str(self.device),
            dtype=str(model.dtype).removeprefix("torch."),
            embed=embed_setup(sentence, int(cfg.hidden_size), matryoshka),
            score_template=score_template,
            classify_pad_id=getattr(cfg, "pad_token_id", None) if cfg.id2label and not model.is_encoder else None,
            state_bytes_per_slot=self.state_bytes_per_slot,
        )
        segments = fused_segments_for(model, self.config)  # once: it logs what it picked
        self.forwards: ForwardProvider = self._forward_provider(segments)
        # LoRA: resident adapter slots, and the forward that takes a LoraStep (the fused or
        # eager segments: compiled segments and captured graphs take plain weights only).
        self.adapters: AdapterSlots | None = None
        if lora is not None:
            if model.is_encoder:
                raise ValueError("LoRA adapters are for decoder models")
            if self.state_bytes_per_slot:
                raise ValueError("LoRA adapters are not served yet for models with recurrent layers")
            self.adapters = AdapterSlots(cfg, lora, model.dtype, self.device)  # type: ignore[arg-type]
        self._lora_forward = functools.partial(model.forward, segments=segments) if segments else model.forward
        self.step_threads = StepThreads(self.device, *decoder_flops(cfg))
        # CPU decoders: the last layer computes only the positions the heads read (read_rows.py);
        # CUDA keeps computing every position (its graphs capture whole steps).
        self.prune_last_layer = (self.config.prune_last_layer and self.device.type == "cpu"
                                 and bool(getattr(model, "computes_read_positions", False)))
        if self.prune_last_layer:
            logger.info("last layer: computed only for the positions a head reads (--no-prune-last-layer: all)")

    def _forward_provider(self, segments: DecoderSegments | None) -> ForwardProvider:
        """Compiled segments where asked for and possible; the eager forward (over the fused
        `segments` where given) otherwise."""
        mode = self.config.compile
        if mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {mode!r}; use one of {', '.join(COMPILE_MODES)}")
        eager = EagerForwards(functools.partial(self.model.forward, segments=segments) if segments else
                              self.model.forward)
        if mode == "off":
            return eager
        why_not = None
        if self.device.type != "cpu":
            why_not = "compiled segments are for the CPU (GPUs use CUDA graphs)"
        elif self.model.is_encoder:
            why_not = "encoders run eagerly"
        elif (unlike := _unlike_llama(self.model)) is not None:
            why_not = f"compiled segments compute the Llama layer; this model has {unlike}"
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
        """The shapes a compile needs, none of the server's state."""
        self._throwaway_forward(num_tokens, segments)

    @torch.inference_mode()
    def _throwaway_forward(self, num_tokens: int, segments: DecoderSegments | None = None) -> torch.Tensor:
        """A forward of a fresh `num_tokens`-token prompt on scratch KV (nothing is written
        or read there); its hidden states."""
        scratch = self.model.allocate_kv_cache(1, self.block_size)
        lay = RowLayout([0] * num_tokens, range(num_tokens), [-1] * num_tokens, (), num_tokens, False, decode=False)
        inputs = self.inputs.flatten([lay], write_kv=False)
        if segments is None:
            return self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, scratch)
        return self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, scratch, segments=segments)

    @torch.inference_mode()
    def device_memory(self, num_tokens: int, num_sampled: int) -> DeviceMemory | None:
        """CUDA: the device's memory now (weights loaded, no KV yet), with the peak
        temporaries of a throwaway forward of `num_tokens` prompt tokens that projects
        `num_sampled` rows to logits (the largest step). None elsewhere: the CPU keeps a
        fixed budget (kv_sizing.py)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        hidden = self._throwaway_forward(num_tokens)
        self.model.compute_logits(hidden[: max(1, min(num_sampled, num_tokens))])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        graphs = 0 if self.config.enforce_eager or self.model.is_encoder else GRAPH_RESERVE_BYTES
        return DeviceMemory(total_bytes=total, free_bytes=free, peak_activation_bytes=peak, graph_reserve_bytes=graphs)

    @classmethod
    def create(
        cls,
        model_config: object,
        weights: dict[str, torch.Tensor],
        config: ExecutorConfig,
        block_size: int,
        max_positions: int | None = None,
        blocks: Mapping[str, GgmlQuants] | None = None,
        lora: LoraConfig | None = None,
        checkpoint_files: Sequence[Path] = (),
        sentence: SentenceModules | None = None,
        matryoshka: tuple[int, ...] | None = None,
        score_template: str | None = None,
    ) -> "ModelRunner":
        """Build the model on the configured device from host weights (which the caller
        drops afterwards: no host copy of a GPU model is kept). `blocks`: a GGUF's
        block-format projections, which CPU decode reads where it can. `checkpoint_files`:
        the files `weights` and `blocks` were read from; on a CPU what the build derives from
        them is kept on disk for the next start (model/loading/prepared.py); () keeps nothing."""
        device = resolve_device(config.device)
        if device.type == "cpu":  # before any of the model's GEMMs (encoders call F.linear directly)
            bound_onednn_caches()
            keep_freed_activations()
        dtype = resolve_dtype(config.dtype, device)
        if device.type == "cpu" and isa_capped_to_avx2():
            logger.info("%s=avx2: running as on an AVX2-only CPU (torch's ATEN_CPU_CAPABILITY=%s, oneDNN's "
                        "ONEDNN_MAX_CPU_ISA=%s)", ISA_CAP_ENV, os.environ.get("ATEN_CPU_CAPABILITY", "unset"),
                        os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"))
        logger.info("dtype %s (%s)", str(dtype).removeprefix("torch."), dtype_reason(config.dtype, device))
        attention = get_attention_backend(resolve_attention_backend(config.attention_backend, device), device)
        describe = getattr(attention, "describe", None)
        logger.info("attention: %s", describe(dtype) if describe is not None else f"backend {attention.name}")
        prepared = (PreparedTensors.for_checkpoint(checkpoint_files, dtype, prepared_dir())
                    if device.type == "cpu" and checkpoint_files else None)
        # Compiled segments take plain weights; eager CPU forwards run faster on prepacked ones.
        model = build_model(model_config, weights, dtype, device, attention, max_positions,  # type: ignore[arg-type]
                            prepack=config.compile == "off", blocks=blocks, prepared=prepared)
        if prepared is not None and prepared.read and not prepared.made:
            logger.info("prepared weights (casts, stacks, AMX copies): read from %s", prepared.path)
        elif prepared is not None and prepared.save():
            logger.info("prepared weights (casts, stacks, AMX copies): %d derived at this start, kept in %s for the next",
                        prepared.made, prepared.path)
        if config.batch_invariant:
            make = getattr(model, "make_batch_invariant", None)
            taken = make() if make is not None else 0
            said = (f"{taken} projections on one route at every row count (amx_gemm.c's dot-product form or "
                    "f32_gemm.c where they serve, else oneDNN's packed copy), no few-row routes" if taken else
                    "no effect here (no prepacked projections on this device or model kind): a request's answers "
                    "may follow what shares its steps")
            logger.info("batch-invariant: %s", said)
        if config.pack_at_start:
            start = time.perf_counter()
            if made := model.make_packed_copies():
                logger.info("%d projections' packed copies: amx_gemm.c's ready at start (%.2f s), oneDNN's by a thread "
                            "meanwhile, not by the first prompt", made, time.perf_counter() - start)
        return cls(model, block_size, config, lora, sentence, matryoshka, score_template)

    def limit_sampled_vocab(self, emittable: int) -> None:
        """Sample only ids below `emittable` (a padded head has rows no tokenizer can spell)."""
        self.emittable_vocab = emittable

    def allocate_kv_cache(self, num_blocks: int, populate: Populate = "off", state_slots: int = 0) -> None:
        """`num_blocks` for the KV manager, plus one scratch block that no request owns:
        padding rows of a replayed graph write their K/V there. `populate`: CacheConfig's.
        `state_slots`: the state pool of a model with recurrent layers (state_bytes_per_slot)."""
        if state_slots and not self.state_bytes_per_slot:
            raise ValueError("state slots for a model without recurrent layers")
        extra = {"state_slots": state_slots} if self.state_bytes_per_slot else {}
        self.kv_caches = self.model.allocate_kv_cache(num_blocks + 1, self.block_size, populate, **extra)
        self.num_state_slots = state_slots
        self._scratch_slot = num_blocks * self.block_size

    # --- KV hand-off (prefill/decode disaggregation): whole blocks, no request state ----

    @torch.inference_mode()
    def read_kv_blocks(self, blocks: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of the K/V of `blocks`, per layer ([len(blocks), block_size, heads,
        head_dim] each): what another runner's `write_kv_blocks` takes."""
        if self.state_bytes_per_slot:
            raise ValueError("the KV hand-off does not carry recurrent state: not served for this model")
        (index,) = copy_int64(self.device, blocks)
        return [(k.index_select(0, index).to("cpu"), v.index_select(0, index).to("cpu")) for k, v in self.kv_caches]

    @torch.inference_mode()
    def write_kv_blocks(self, blocks: Sequence[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy K/V read by `read_kv_blocks` (any runner of the same model) into `blocks`."""
        if self.state_bytes_per_slot:
            raise ValueError("the KV hand-off does not carry recurrent state: not served for this model")
        if len(kv) != len(self.kv_caches):
            raise ValueError(f"KV of {len(kv)} layers for a model of {len(self.kv_caches)}")
        (index,) = copy_int64(self.device, blocks)
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
        if self.model.is_encoder or not self.kv_caches or self.state_bytes_per_slot:
            return  # recurrent layers run eagerly (their rows' states are not graph inputs)
        attention = getattr(self.model, "attention", None)
        reads_row_tensors = bool(getattr(attention, "reads_prefill_tensors", False))
        config = config or GraphConfig(capture_prefill=reads_row_tensors)
        if config.capture_prefill and not reads_row_tensors:
            raise ValueError("prefill graphs need an attention backend that reads PrefillTensors (triton)")
        # With LoRA slots the graphs take the per-token adapter index as an input (the
        # kernels read it on the device: Triton on CUDA; the C kernel when emulated on a CPU).
        slots = self.adapters.slots if self.adapters is not None else None
        adapter_index = slots is not None and (self.device.type == "cuda" or slots.kernel is not None)

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                    adapter_slots: torch.Tensor | None) -> torch.Tensor:
            if adapter_slots is None or slots is None:
                return self.forwards.forward_for(ids.shape[0])(ids, pos, meta, self.kv_caches)
            return self._lora_forward(ids, pos, meta, self.kv_caches, lora=LoraStep(slots, LoraBatch.on_device(adapter_slots)))

        self.graphs = GraphRunner(
            forward, config, self.device, self.block_size, max_blocks_per_row=-(-max_model_len // self.block_size),
            scratch_slot=self._scratch_slot, capture=capture, adapter_index=adapter_index,
        )

    # --- forwards -----------------------------------------------------------------------

    def forward(self, inputs: StepInputs, lora: LoraStep | None = None, reads: StepReads | None = None) -> torch.Tensor:
        """The trunk's hidden states: [T, H], or with `reads` those of the read positions only."""
        if reads is not None:  # never a graph's step (step_reads_for)
            if lora is not None:
                return self._lora_forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, lora=lora,
                                          reads=reads.positions)
            forward = self.forwards.forward_for(inputs.input_ids.shape[0])
            return forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, reads=reads.positions)
        # Captured graphs take no segment ids: multi-item rows always run eagerly.
        if self.graphs is not None and inputs.token_type_ids is None and inputs.meta.segment_ids is None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta,
                                     None if lora is None else lora.batch.token_slots)
            if hidden is not None:
                return hidden
        if lora is not None:
            return self._lora_forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, lora=lora)
        forward = self.forwards.forward_for(inputs.input_ids.shape[0])
        return forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, inputs.token_type_ids)

    def _carry(self, inputs: StepInputs, rows: Sequence[BatchRow], carried: CarriedTokens | None) -> None:
        """Put the carried tokens (sampled by the step in flight) into the inputs of the
        carried rows: one gather and one scatter on the device, queued behind that step."""
        if carried is None or not carried.request_ids:
            return
        source = carried.source
        if source.sampled_ids is None:
            raise ValueError("carried rows follow a step that samples nothing")
        where = {r.request_id: i for i, r in enumerate(rows)}
        dst, src = copy_int64(self.device, [inputs.starts[where[rid]] for rid in carried.request_ids],
                              [source.sampled_rows[rid] for rid in carried.request_ids])
        inputs.input_ids.index_copy_(0, dst, source.sampled_ids.index_select(0, src).to(inputs.input_ids.dtype))

    def _adapter_heads(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """Rows whose adapter carries its own classification head: request id -> head."""
        if self.adapters is None:
            return {}
        rows = batch.rows + (batch.oneshot_rows if isinstance(batch, MixedBatch) else ())
        found = {r.request_id: self.adapters.head(r.lora) for r in rows if r.lora is not None and r.head is not None}
        return {rid: head for rid, head in found.items() if head is not None}

    def lora_step(self, rows: Sequence[tuple[LoraRequest | None, int]]) -> LoraStep | None:
        """The adapters of a step's rows (each row's adapter and computed token count, in
        the forward's row order), loaded into slots; None when every row is the base."""
        if all(lora is None for lora, _ in rows):
            return None
        if self.adapters is None:
            raise ValueError("a row names a LoRA adapter but LoRA is off (no --max-loras slots)")
        slots = self.adapters.slots_for([lora for lora, _ in rows])
        batch = LoraBatch.build(slots, [n for _, n in rows], self.device, self.adapters.slots.num_slots)
        return None if batch is None else LoraStep(self.adapters.slots, batch)

    # --- one entry point, one path per class ------------------------------------------

    @torch.inference_mode()
    def launch(self, batch: ForwardBatch, carried: CarriedTokens | None = None,
               on_heads: Callable[[], None] | None = None) -> LaunchedStep:
        """Queue the forward, sampling, heads and the one result copy; on CUDA this returns
        while the device still works, so the host can schedule the next step meanwhile.
        `carried`: the carried rows (decode overlap): decode rows whose input tokens the
        step in flight samples. On a CPU the trunk and the heads each run on one
        thread when they are too small to split (step_threads.py)."""
        if carried is not None and isinstance(batch, OneShotBatch):
            raise ValueError("a OneShot step has no rows to carry tokens into")
        tokens, sampled = step_size(batch)
        with self.step_threads.measured_step():
            with self.step_threads.for_trunk(tokens):
                hidden, starts, rows, reads = self.trunk(batch, carried)
            forward_done = time.perf_counter()
            if on_heads is not None:
                on_heads()
            with self.step_threads.for_heads(tokens, sampled):
                launched = self.outputs.launch(hidden, starts, rows, self.emittable_vocab,
                                               self._adapter_heads(batch), None if reads is None else reads.rows)
        launched.forward_done = forward_done
        launched.heads_heavy = self.heads_outweigh_trunk(tokens, sampled)
        return launched

    def heads_outweigh_trunk(self, tokens: int, sampled: int) -> bool:
        """Whether, on a CPU, a step's LM head over its `sampled` rows has at least the
        multiply-adds of its trunk over `tokens` (decode of a small model with a large
        vocabulary: the free model's head outweighs its trunk many times over a row,
        SmolLM2-135M's is a fraction of it)."""
        threads = self.step_threads
        return (self.device.type == "cpu" and sampled > 0
                and sampled * threads.flops_per_logit_row >= tokens * threads.flops_per_token > 0)

    def trunk(self, batch: ForwardBatch, carried: CarriedTokens | None = None) -> tuple[
            torch.Tensor, list[int], list[tuple[str, list[int], SampleSpec | None, HeadSpec | None]],
            StepReads | None]:
        """The trunk of one step (what `launch` runs before the heads): hidden states, each
        row's start in them, what each row asks of the heads (request id, the tokens
        computed, sampling, head) and, when the last layer computed only the positions
        read, which those are. Tests that compare hidden states call it with the batch a
        scheduler would build."""
        if isinstance(batch, OneShotBatch):
            self._copy_partial_blocks(batch.rows)
            inputs = self.inputs.oneshot(batch.rows)
            row_loras = [(r.lora, len(r.token_ids) - r.num_cached) for r in batch.rows]
            # Heads see the computed suffix only (prefix-hit rows never need earlier rows).
            rows = [(r.request_id, r.token_ids[r.num_cached :], r.sample, r.head) for r in batch.rows]
        elif isinstance(batch, MixedBatch) and batch.oneshot_rows:  # a fused step
            self._copy_partial_blocks(batch.oneshot_rows, batch.rows if self.state_bytes_per_slot else ())
            inputs = self.inputs.fused(batch.rows, batch.oneshot_rows)
            self._carry(inputs, batch.rows, carried)
            row_loras = ([(r.lora, len(r.token_ids)) for r in batch.rows]
                         + [(r.lora, len(r.token_ids) - r.num_cached) for r in batch.oneshot_rows])
            rows = [(r.request_id, r.token_ids, r.sample, r.head) for r in batch.rows]
            rows += [(r.request_id, r.token_ids[r.num_cached :], r.sample, r.head) for r in batch.oneshot_rows]
        else:
            assert isinstance(batch, (DecodeBatch, MixedBatch))
            if self.state_bytes_per_slot:  # a hit of a hybrid model's paged row may end inside a block
                self._copy_partial_blocks((), batch.rows)
            inputs = self.inputs.paged(batch.rows)
            self._carry(inputs, batch.rows, carried)
            row_loras = [(r.lora, len(r.token_ids)) for r in batch.rows]
            rows = [(r.request_id, r.token_ids, r.sample, r.head) for r in batch.rows]
        lora = self.lora_step(row_loras)
        # a decode step reads every row's one token: no need to look
        reads = None if isinstance(batch, DecodeBatch) else self.step_reads_for(inputs, rows)
        if reads is not None and lora is not None:  # the read rows' adapters, for the last layer
            counts = [n if read is None else len(read) for (_, n), read in zip(row_loras, reads.rows)]
            read_lora = self.lora_step([(adapter, c) for (adapter, _), c in zip(row_loras, counts)])
            reads = dataclasses.replace(reads, positions=dataclasses.replace(reads.positions, lora=read_lora))
        hidden = self.forward(inputs, lora, reads)
        return hidden, inputs.starts if reads is None else reads.starts, rows, reads

    def _copy_partial_blocks(self, rows: Sequence[OneShotRow], paged: Sequence[BatchRow] = ()) -> None:
        """Rows whose cache hit ends inside a block: that block's cached slots, copied into
        the row's own copy of it (a OneShot row's first publish block, a paged row's block
        at its start) in every layer, before the forward reads them as prefix and writes
        the rest (OneShotRow.copy_from, BatchRow.copy_from)."""
        bs = self.block_size
        src: list[int] = []
        dst: list[int] = []
        for r in rows:
            if r.copy_from is not None:
                n = r.num_cached % bs
                src += range(r.copy_from * bs, r.copy_from * bs + n)
                dst += range(r.publish_blocks[0] * bs, r.publish_blocks[0] * bs + n)
        for p in paged:
            if p.copy_from is not None:
                n, own = p.start_pos % bs, p.block_table[p.start_pos // bs]
                src += range(p.copy_from * bs, p.copy_from * bs + n)
                dst += range(own * bs, own * bs + n)
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        # A hybrid model's linear layers keep state slots, not blocks: its attention layers only
        full_layers = getattr(self.model, "full_layers", None)
        paged = self.kv_caches if full_layers is None else [self.kv_caches[i] for i in full_layers]
        for k_cache, v_cache in paged:
            for cache in (k_cache, v_cache):
                slots = cache.view(-1, *cache.shape[2:])  # [blocks * block_size, kv_heads, head_dim]
                slots.index_copy_(0, dst_t, slots.index_select(0, src_t))

    def step_reads_for(self, inputs: StepInputs,
                       rows: Sequence[tuple[str, list[int], SampleSpec | None, HeadSpec | None]]) -> StepReads | None:
        """The positions the heads read of a step's rows, where the last layer can compute
        those alone (None: it computes every position)."""
        if not self.prune_last_layer or self.graphs is not None or inputs.token_type_ids is not None:
            return None
        lens = [len(tokens) for _, tokens, _, _ in rows]
        reads = [row_read(n, sample, head, self.model.default_pooling)
                 for n, (_, _, sample, head) in zip(lens, rows)]
        return step_reads(self.device, inputs.starts, lens, reads, [p.query_start for p in inputs.meta.prefills])
