"""The decoder trunk the architecture files compose: embeddings, layers of attention and a
gated MLP over shared layers, a final norm, and the heads, as the architecture's
description (model/spec.py) says each layer is.

The trunk works on a flattened batch of tokens [T] from any mix of rows; attention
goes through a backend that reads/writes the paged KV cache. Heads are separate: the
trunk returns hidden states, `compute_logits` projects only the rows asked for.
Every checkpoint tensor is read through CastWeights, which records what was read: a
tensor left unread (a bias, a norm, an expert the description does not have) refuses the
checkpoint, as does a missing one, each by name.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from prelude.config import ModelConfig, Populate
from prelude.model.attention import AttentionBackend, get_attention_backend
from prelude.model.attention.metadata import AttentionMetadata
from prelude.model.base import DerivedTensors, KVCaches, NothingKept, UnsupportedCheckpoint
from prelude.model.spec import DecoderSpec, LayerSpec
from prelude.model.read_positions import ReadPositions
from prelude.model.layers.decoder_segments import (
    ACTIVATIONS,
    EAGER_SEGMENTS,
    DecoderSegments,
    PreAttention,
    LayerShape,
    Linear,
    PostAttention,
)
from prelude.model.fast_paths import decode_routes
from prelude.kernels.cpu.head_argmax import HeadArgmax
from prelude.model.fast_paths import greedy_head
from prelude.kernels.cpu.quant_gemm import QuantKernel, load_kernel
from prelude.kernels.ggml_quants import GgmlQuants
from prelude.model.attention.kv_memory import zeroed_kv_tensors
from prelude.model.fast_paths.layer_loop import LayerLoop, layer_loop_for
from prelude.model.layers.linear import QuantPath, Projection, describe_routes, prepack_enabled
from prelude.model.lora.adapters import LoraStep
from prelude.model.layers.moe import SparseMoe, describe as describe_moe
from prelude.model.layers.rotary import RotaryEmbedding


logger = logging.getLogger("prelude.model.decoder")

# Tensors some checkpoints carry that no forward reads (rotary tables saved by old exporters)
_NEVER_READ = (".rotary_emb.inv_freq",)

BlocksFor = Callable[..., QuantPath | None]  # weight names (stacked in order) -> their blocks


def _operand(p: Projection) -> Linear:
    """The prepacked projection itself where there is one (it picks its path by row
    count), else the plain weight."""
    return p if p.packed else p.weight


class CastWeights(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors in the model's dtype and on its device, each converted at its
    first read; `stacked` converts pieces straight into one fused tensor. A bf16 start of
    SmolLM2-135M had cast every float32 tensor and then copied q/k/v and gate/up again into
    their fused weights (`torch.cat`, a visible share of its start-up); the values are the same (one
    rounding of each float32 value either way). Casts and stacks come from `prepared` where
    an earlier start kept them."""

    def __init__(self, source: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 prepared: DerivedTensors) -> None:
        self._source, self._dtype, self._device, self._prepared = source, dtype, device, prepared
        self._cast: dict[str, torch.Tensor] = {}
        self._read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        found = self._cast.get(name)
        if found is None:
            if name not in self._source:
                raise UnsupportedCheckpoint(f"the checkpoint has no tensor {name}, which this architecture reads")
            self._read.add(name)
            tensor = self._source[name]
            if tensor.dtype == self._dtype:  # the checkpoint's own tensor: nothing derived to keep
                found = tensor.to(device=self._device)
            else:
                found = self._prepared.tensor(f"cast:{name}",
                                              lambda: tensor.to(dtype=self._dtype, device=self._device))
            self._cast[name] = found
        return found

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def get(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:  # type: ignore[override]
        return self[name] if name in self._source else default

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)

    def stacked(self, names: Sequence[str]) -> torch.Tensor:
        """The tensors `names` stacked along their first dimension, in the model's dtype."""
        for name in names:
            if name not in self._source:
                raise UnsupportedCheckpoint(f"the checkpoint has no tensor {name}, which this architecture reads")
        self._read.update(names)
        return self._prepared.tensor("stack:" + "|".join(names), lambda: self._stack(names))

    def check_all_read(self, architecture: str) -> None:
        """Refuse the checkpoint if a tensor was left unread: the model would compute
        without it."""
        unread = sorted(n for n in self._source if n not in self._read and not n.endswith(_NEVER_READ))
        if unread:
            more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
            raise UnsupportedCheckpoint(f"architecture {architecture}: the checkpoint's tensors {', '.join(unread[:3])}"
                                        f"{more} are not read by this architecture (the engine would compute "
                                        "the model without them)")

    def _stack(self, names: Sequence[str]) -> torch.Tensor:
        parts = [self._source[n] for n in names]
        out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=self._dtype,
                          device=self._device)
        at = 0
        for part in parts:
            out[at:at + part.shape[0]].copy_(part)
            at += part.shape[0]
        return out


class DecoderLayer:
    """Weights of one layer; q/k/v and gate/up are fused into single matmuls."""

    def __init__(self, weights: CastWeights, prefix: str, spec: LayerSpec, prepack: bool,
                 blocks_for: BlocksFor) -> None:
        w = lambda name: weights[prefix + name]  # noqa: E731
        stacked = lambda *names: weights.stacked([prefix + n for n in names])  # noqa: E731
        blk = lambda *names: blocks_for(*(prefix + n for n in names))  # noqa: E731
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        qkv_bias = (stacked("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
                    if spec.attention.qkv_bias else None)
        self.qkv = Projection(
            stacked("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            qkv_bias, prepack, blk("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))
        self.o_proj = Projection(w("self_attn.o_proj.weight"), None, prepack, blk("self_attn.o_proj.weight"))
        # Gemma's sandwich: post_attention_layernorm normalizes the attention's output, these
        # two the MLP's input and output
        self.pre_mlp_norm = w("pre_feedforward_layernorm.weight") if spec.post_norms else None
        self.post_mlp_norm = w("post_feedforward_layernorm.weight") if spec.post_norms else None
        self.q_norm = w("self_attn.q_norm.weight") if spec.attention.qk_norm else None
        self.k_norm = w("self_attn.k_norm.weight") if spec.attention.qk_norm else None
        self.pre_attention = PreAttention(self.input_norm, _operand(self.qkv), None if self.qkv.packed else self.qkv.bias,
                                self.q_norm, self.k_norm)
        # A mixture of experts runs its own GEMMs (model/layers/moe.py); a dense MLP two projections
        self.moe: SparseMoe | None = None
        self.gate_up: Projection | None = None
        self.down: Projection | None = None
        if spec.mlp.kind == "moe":
            assert spec.mlp.moe is not None
            self.moe = SparseMoe.from_checkpoint(weights, prefix + "mlp.", spec.mlp.moe, ACTIVATIONS[spec.mlp.activation])
            expert_blocks = (blk("mlp.experts.gate_up_proj"), blk("mlp.experts.down_proj"))
            if expert_blocks[0] is not None and expert_blocks[1] is not None:  # a GGUF's experts in their blocks
                self.moe.read_blocks(*expert_blocks)
            self.post_attention = PostAttention(_operand(self.o_proj), self.post_norm, None, None, self.moe)
        else:
            self.gate_up = Projection(stacked("mlp.gate_proj.weight", "mlp.up_proj.weight"), None, prepack,
                                      blk("mlp.gate_proj.weight", "mlp.up_proj.weight"))
            self.down = Projection(w("mlp.down_proj.weight"), None, prepack, blk("mlp.down_proj.weight"))
            self.post_attention = PostAttention(_operand(self.o_proj), self.post_norm, _operand(self.gate_up),
                                    _operand(self.down))

    @property
    def projections(self) -> tuple[Projection, ...]:
        """qkv, o_proj, gate_up and down (a dense MLP's), in the order a layer runs them."""
        mlp = () if self.gate_up is None or self.down is None else (self.gate_up, self.down)
        return (self.qkv, self.o_proj, *mlp)


class DecoderHeads:
    """The heads a decoder serves over its final hidden states, shared by the architectures
    whose trunks differ (`rope`, `lm_head`, `_lm_head_proj` and `score` are the model's)."""

    rope: RotaryEmbedding
    lm_head: torch.Tensor | None
    _lm_head_proj: Projection | None
    score: torch.Tensor | None

    @property
    def max_positions(self) -> int:
        return int(self.rope.cos.shape[0])

    @property
    def can_generate(self) -> bool:
        return self.lm_head is not None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project the selected rows [R, hidden] to float32 logits [R, vocab]."""
        if self._lm_head_proj is None:
            raise RuntimeError("this checkpoint has no language-model head")
        return self._lm_head_proj(hidden).float()

    @torch.inference_mode()
    def compute_label_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of only the given vocabulary ids: [R, hidden] x ids [K] -> [R, K] (float32).
        A gather of K rows of the head's weight, not a full-vocabulary projection."""
        if self.lm_head is None:
            raise RuntimeError("this checkpoint has no language-model head")
        return F.linear(hidden, self.lm_head.index_select(0, token_ids)).float()

    @torch.inference_mode()
    def classify(self, hidden_row: torch.Tensor) -> torch.Tensor:
        """Classification / reward head on a sequence's last token, as HF's
        *ForSequenceClassification does: [n, hidden] -> [labels] (float32)."""
        if self.score is None:
            raise RuntimeError("this checkpoint has no classification head")
        return F.linear(hidden_row[-1], self.score).float()


class Decoder(DecoderHeads):
    """Inference-only decoder over shared layers, as `spec` describes it: weights are plain
    tensors, no autograd."""

    def __init__(
        self,
        config: ModelConfig,
        spec: DecoderSpec,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        attention: AttentionBackend | None = None,
        max_positions: int | None = None,
        prepack: bool = True,
        blocks: Mapping[str, GgmlQuants] | None = None,
        prepared: DerivedTensors | None = None,
    ) -> None:
        """`prepared`: what an earlier start derived from these weights (model/loading/prepared.py);
        this build's casts, stacks and stacked blocks are read from it or made and kept in it."""
        self.config = config
        self.spec = spec
        self._check_spec(spec)
        self.dtype = dtype
        self.device = torch.device(device)
        prepared = prepared if prepared is not None else NothingKept()
        cast = CastWeights(weights, dtype, self.device, prepared)
        self.embed = cast["model.embed_tokens.weight"]
        prepack = prepack and prepack_enabled(dtype, self.device)
        if prepack:
            logger.info("%s", describe_routes(dtype))
        # Decode reads a GGUF's block-format projections (float32 activations on the CPU, or
        # bf16 on an AVX512-BF16 one) for the row counts where that measured faster.
        kernel = load_kernel() if prepack and blocks else None
        if kernel is not None and not kernel.takes(dtype):
            kernel = None

        def blocks_for(*names: str) -> QuantPath | None:
            if kernel is None or not blocks:
                return None
            stacked = prepared.blocks("blocks:" + "|".join(names),
                                      lambda: GgmlQuants.cat([blocks.get(n) for n in names]))
            return None if stacked is None else QuantPath(stacked, kernel)

        self.layers = [
            DecoderLayer(cast, f"model.layers.{i}.", layer, prepack, blocks_for)
            for i, layer in enumerate(spec.layers)
        ]
        self._pre = [layer.pre_attention for layer in self.layers]
        self._post = [layer.post_attention for layer in self.layers]
        self.norm = cast["model.norm.weight"]
        # A *ForSequenceClassification checkpoint has a `score` head instead of an LM head; a
        # trunk saved on its own (`Qwen3Model`, an embedder's) has none unless tied.
        self.score = cast.get("score.weight")
        bare_trunk = spec.architecture.endswith("Model")
        if "lm_head.weight" in cast:
            self.lm_head: torch.Tensor | None = cast["lm_head.weight"]
        else:
            self.lm_head = (self.embed if config.tie_word_embeddings or (self.score is None and not bare_trunk)
                            else None)
        head_name = "lm_head.weight" if "lm_head.weight" in cast else "model.embed_tokens.weight"
        self._lm_head_proj = (Projection(self.lm_head, None, prepack, blocks_for(head_name), head=True)
                              if self.lm_head is not None else None)
        self._head_argmax: HeadArgmax | None | Literal[False] = None  # False: not on this CPU
        self._copies_thread: threading.Thread | None = None  # making oneDNN's copies (make_packed_copies)
        # Where decode reads GGUF blocks instead of oneDNN (None: no blocks in this model/CPU/dtype)
        self.decode_route: decode_routes.RouteChoice | None = None
        self.head_route: decode_routes.RouteChoice | None = None  # the LM head's, where it has blocks
        if prepack and prepared.path is not None:  # before the decode route: a measure times these copies
            self._adopt_amx_copies(prepared)
        if kernel is not None:
            self._choose_decode_route(kernel)
        self.attention = attention or get_attention_backend("torch")
        self.rope = RotaryEmbedding(config, max_positions or config.max_position_embeddings, dtype, self.device)
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.shape = LayerShape(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                config.rms_norm_eps, spec.layers[0].mlp.activation)
        cast.check_all_read(spec.architecture)
        self._moe = {i: layer.moe for i, layer in enumerate(self.layers) if layer.moe is not None}
        if self._moe:
            logger.info("%s", describe_moe(self._moe, dtype))
        # Small steps (up to 32 or 128 tokens, by the routes): the layer loop in one C call where
        # every kernel has a C route (None: the Python loop runs every step; `bench profile`
        # sets it so to split a step)
        self.layer_loop: LayerLoop | None = self._layer_loop()
        if self.layer_loop is not None:
            logger.info("steps of 1-%d tokens: the layer loop in one C call (layer_loop.c)", self.layer_loop.max_rows)
        elif (unlike := spec.is_plain_llama()) is not None:
            logger.info("every step: the layers in Python (the C layer loop computes the Llama layer; this model "
                        "has %s)", unlike)

    @staticmethod
    def _check_spec(spec: DecoderSpec) -> None:
        """Refuse a description this trunk cannot compute (each layer alike: full attention,
        or Mistral's one window on every layer, which the engine applies as a context cap;
        plain RMSNorms; a gated MLP, dense or a mixture of experts, of one activation for
        every layer)."""
        first = spec.layers[0]
        for i, layer in enumerate(spec.layers):
            a = layer.attention
            why = ("a layer unlike the first" if (layer.mlp.activation, layer.norm, a.kind, a.window)
                   != (first.mlp.activation, first.norm, first.attention.kind, first.attention.window) else
                   f"{a.kind} attention" if a.kind == "linear" else
                   "partial rotary" if a.rope is None or a.rope.rotary_dim != a.head_dim else
                   "attention soft-capping" if a.logit_softcap is not None else
                   "an attention output gate" if a.output_gate else
                   f"a {layer.norm} norm" if layer.norm != "rms" else
                   "post-attention and post-MLP norms" if layer.post_norms else None)
            if why is not None:
                raise UnsupportedCheckpoint(f"architecture {spec.architecture}: layer {i} has {why}, which the "
                                            "decoder trunk does not compute")
        if spec.embed_scale is not None or spec.final_logit_softcap is not None or spec.final_norm != "rms":
            raise UnsupportedCheckpoint(f"architecture {spec.architecture}: scaled embeddings, logit soft-capping "
                                        "and other final norms are not computed by the decoder trunk")

    def _projections(self) -> list[Projection]:
        projections = [p for layer in self.layers for p in layer.projections]
        return projections + ([self._lm_head_proj] if self._lm_head_proj is not None else [])

    def _adopt_amx_copies(self, prepared: DerivedTensors) -> None:
        """amx_gemm.c's copies from the prepared file (made and kept there the first time):
        a visible share of a bf16 start on an AMX CPU, where the C layer loop takes them at
        build. Keyed by the projection's place in the model and its shape (the digested code
        fixes the order)."""
        for i, p in enumerate(self._projections()):
            p.amx_copy_from(functools.partial(prepared.tensor, f"amx:{i}:{p.out_features}x{p.weight.shape[1]}"))

    def make_packed_copies(self) -> int:
        """In bf16, where every call of a prepacked projection past the few-row routes takes
        a packed copy, make them now: amx_gemm.c's here (calls past the few-row routes up to
        its max_rows, and the C layer loop read them), oneDNN's on a thread where a call can
        take them (longer calls: work a serving engine's start no longer waits for; the
        first forward waits for the rest, so a process's memory holds them all from its
        first answer on). Returns how many projections have them. In
        float32 only f32_gemm.c's (a CPU without AVX-512): oneDNN's serve decode sizes and
        calls from a 128-row step up, so a server that scores short texts never needs them,
        and the first call that does makes them."""
        if self.dtype != torch.bfloat16:
            # float32 on a CPU without AVX-512: f32_gemm.c's copies now, so no prompt pays them
            return sum(p.gemm_copy() is not None for p in self._projections() if p.f32_gemm is not None)
        projections = [p for p in self._projections() if p.packed]
        if not projections:
            return 0
        for p in projections:
            p.amx_copy()

        def onednn_copies() -> None:
            start = time.perf_counter()
            made = sum(p.make_packed_copy() for p in projections if p.reads_onednn_copy)
            logger.info("%d projections' oneDNN packed copies made by a thread (%.2f s)", made,
                        time.perf_counter() - start)

        # Not a daemon (said outright: a server builds its model on its daemon engine thread,
        # whose threads inherit that): a process that exits meanwhile (a server stopped right
        # after ready) waits for the copies, since a daemon thread inside a torch op at
        # interpreter exit aborts it ("terminate called without an active exception", SIGABRT).
        self._copies_thread = threading.Thread(target=onednn_copies, name="prelude-onednn-copies", daemon=False)
        self._copies_thread.start()
        return len(projections)

    def make_batch_invariant(self) -> int:
        """Every projection on one route for every row count (Projection.take_one_route) and
        the attention backend's own invariant choice: a request's greedy tokens then do not
        depend on which requests share its steps. The elementwise kernels are per row
        already (docs/batch.md says what is left). The C layer loop is rebuilt over the one
        routes: where each is a GEMM of our own (amx_gemm.c's dot-product form, f32_gemm.c)
        it calls that GEMM at every row count, as the projections now do, and the
        attention with the backend's options; elsewhere (oneDNN's copy) there is none.
        A mixture of experts runs each token alone through its experts (model/layers/moe.py).
        Returns how many projections took the one route (0: none has a packed copy here,
        and the projections are as they were)."""
        taken = sum(p.take_one_route() for p in self._projections())
        for block in self._moe.values():
            block.make_batch_invariant()
        if self._moe:
            logger.info("%s", describe_moe(self._moe, self.dtype))
        make = getattr(self.attention, "make_batch_invariant", None)
        if make is not None:
            make()
        if taken:
            self.decode_route = self.head_route = None
            self.layer_loop = self._layer_loop() if self.layer_loop is not None else None
        return taken

    def _layer_loop(self) -> LayerLoop | None:
        """The C layer loop over the layers' projections as they route now (and the attention
        backend's current options), or None where no step would run wholly in C."""
        unlike = self.spec.is_plain_llama()
        if unlike is not None:  # the C loop computes the Llama layer only
            if self.device.type == "cpu":
                logger.info("the C layer loop: not for this model (it has %s): the Python loop runs every step", unlike)
            return None
        return layer_loop_for(self.layers, self.norm, self.attention, self.dtype, self.config, self.scale)

    def _choose_decode_route(self, kernel: QuantKernel) -> None:
        """Blocks or the dense route per decode row count, as measured on this CPU
        (decode_routes.py): the layers' projections together, the LM head on its own (its
        dense route is oneDNN's alone, amx_gemm.c serving no head, so its crossover is its own)."""
        with_blocks = [p for p in self._projections() if p.blocks is not None]
        head = [p for p in with_blocks if p is self._lm_head_proj]
        trunk = [p for p in with_blocks if p is not self._lm_head_proj]
        self.decode_route = self._route_for(trunk, kernel, "the layers' projections")
        self.head_route = self._route_for(head, kernel, "the LM head")

    def _route_for(self, group: list[Projection], kernel: QuantKernel,
                   what: str) -> decode_routes.RouteChoice | None:
        """The measured route choice for `group` (projections with blocks), applied to them."""
        if not group:
            return None
        pairs = [(p.weight, p.blocks.blocks) for p in group]  # type: ignore[union-attr]
        choice = decode_routes.choose(pairs, kernel, self.dtype, [p.gemm_copy for p in group])
        logger.info("%s", choice.describe(self.dtype, what))
        for p in group:
            p.limit_blocks(choice.blocks_max_rows)
        return choice

    @property
    def weights_are_plain(self) -> bool:
        """True when every projection is a plain tensor (none prepacked): what compiled
        segments accept."""
        return all(isinstance(t, torch.Tensor) for layer in self.layers
                   for t in (layer.pre_attention.qkv, *layer.post_attention) if t is not None)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        token_type_ids: torch.Tensor | None = None,
        segments: DecoderSegments = EAGER_SEGMENTS,
        lora: LoraStep | None = None,
        reads: ReadPositions | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final-normed hidden states [T, hidden].
        `token_type_ids` exists for the shared forward signature; decoders have none.
        `segments` run the math between attention calls (compiled copies come from the
        executor); attention itself always runs through the backend, eagerly. `lora`: the
        resident adapters and each token's slot; its deltas ride in the projection
        operands (None: the plain weights, not one op more). `reads`: the positions whose
        hidden states are read; the last layer computes only those after its K/V (written
        for every token) and the result is [K, hidden] in their order (None: every position);
        with `lora`, the last layer's o_proj and MLP take `reads.lora`, the read rows' index."""
        if self._copies_thread is not None:  # the first forward waits for oneDNN's copies (make_packed_copies)
            self._copies_thread.join()
            self._copies_thread = None
        h = self.embed.index_select(0, input_ids)
        cos, sin = self.rope.tables(positions)  # gathered once, shared by every layer
        driver = self.layer_loop
        if driver is not None and lora is None and segments.label == "cpu" and driver.takes(h.shape[0], meta, reads):
            return driver.run(h, cos, sin, meta, kv_caches, reads)
        if lora is None:
            pres, posts = self._pre, self._post
        else:
            pres = [lora.pre_attention(i, w) for i, w in enumerate(self._pre)]
            # with `reads` the last layer's second half runs on the read rows only: their adapters
            last_step = lora if reads is None else reads.lora
            n = len(self._post)
            posts = [lora.post_attention(i, w) for i, w in enumerate(self._post[:-1])]
            posts.append(self._post[-1] if last_step is None else last_step.post_attention(n - 1, self._post[-1]))
        q, k, v = segments.first(self.shape, h, pres[0], cos, sin)
        last = len(posts) - 1
        for i, (post, (k_cache, v_cache)) in enumerate(zip(posts, kv_caches, strict=True)):
            if i == last and reads is not None:
                return self._last_layer_read(h, q, k, v, k_cache, v_cache, meta, post, segments, reads)
            attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
            if i < last:
                h, q, k, v = segments.between(self.shape, h, attn, post, pres[i + 1], cos, sin)
            else:
                h = segments.last(self.shape, h, attn, post, self.norm)
        return h

    def _last_layer_read(self, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, post: PostAttention,
                         segments: DecoderSegments, reads: ReadPositions) -> torch.Tensor:
        """The last layer for the read positions only: the backend writes every token's
        K/V and attends (where it can) only the read rows' tails; o_proj, the MLP and the
        final norm run on the read rows."""
        if getattr(self.attention, "attends_tails", False):
            attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale,  # type: ignore[call-arg]
                                          tail_queries=reads.tail_queries)
        else:  # a backend that attends every query: the unread rows are dropped after
            attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        if reads.index.numel() == 0:
            return h.new_empty((0, h.shape[1]))
        return segments.last(self.shape, h.index_select(0, reads.index), attn.index_select(0, reads.index), post,
                             self.norm)

    is_encoder = False
    default_pooling = "last"
    computes_read_positions = True


    @torch.inference_mode()
    def greedy_token_ids(self, hidden: torch.Tensor, vocab_limit: int | None) -> torch.Tensor | None:
        """The argmax of `compute_logits(hidden)` below `vocab_limit` per row (int64 [R]) where
        head_argmax.py finds it without the logits, the same token (1..16 float32 rows through
        row_gemv.c's kernels, on an AVX512_BF16 CPU); None elsewhere."""
        head = self._lm_head_proj
        if head is None or not greedy_head.serves(head, hidden):
            return None
        if self._head_argmax is None:  # made on the first greedy step it serves
            self._head_argmax = greedy_head.head_argmax_for(head) or False
        if self._head_argmax is False:
            return None
        out = head.weight.shape[0]
        return self._head_argmax.argmax(hidden, out if vocab_limit is None else min(vocab_limit, out))

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          populate: Populate = "off") -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        tensors = zeroed_kv_tensors(2 * self.config.num_hidden_layers, shape, self.dtype, self.device, populate)
        return list(zip(tensors[0::2], tensors[1::2], strict=True))

    def kv_bytes_per_block(self, block_size: int) -> int:
        per_token = 2 * self.config.num_key_value_heads * self.config.head_dim * self.dtype.itemsize
        return per_token * block_size * self.config.num_hidden_layers
