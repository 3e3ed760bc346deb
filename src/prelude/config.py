"""Frozen configuration records shared by every layer.

Lower layers (model/, kv/) receive only the config they need; nothing here holds
mutable state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


# When a CPU KV pool's pages are faulted in (model/kv_memory.py): at their first write, when the
# pool is made, or by a thread beside the rest of start-up.
Populate = Literal["off", "start", "background"]


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read from its HF config (model/arch/ reads and
    checks it; `architecture` is the registry's name for it)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral: attention span; the engine caps the context to it
    id2label: tuple[str, ...] = ()  # *ForSequenceClassification checkpoints: one name per head output
    expert_layers: tuple[int, ...] = ()  # layers whose MLP is a mixture of experts (model/layers/moe.py)
    architecture: str = "LlamaForCausalLM"  # HF `architectures` (model/registry.py)
    # *ForSequenceClassification: transformers reads the last token that is not this one
    pad_token_id: int | None = None

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF `config.json` dictionary."""
        model_type = str(cfg.get("model_type", "llama"))
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // n_heads
        eos = cfg.get("eos_token_id")
        eos_ids: tuple[int, ...] = ()
        if isinstance(eos, int):
            eos_ids = (eos,)
        elif isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
        rope_scaling = cfg.get("rope_scaling")
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=tuple(sorted(rope_scaling.items())) if isinstance(rope_scaling, dict) else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
            eos_token_ids=eos_ids,
            id2label=_labels(cfg) if _is_classifier(cfg) else (),
            pad_token_id=cfg["pad_token_id"] if isinstance(cfg.get("pad_token_id"), int) else None,
            sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) else None,
        )


def _is_classifier(cfg: dict[str, Any]) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    id2label = cfg.get("id2label") or {}
    n = int(cfg.get("num_labels") or len(id2label) or 1)
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks (see executor/kv_sizing.py)."""

    block_size: int = 16
    # None: on CUDA what is left of gpu_memory_utilization after weights, activations and
    # graphs; on the CPU 1 GiB. Set: exactly this budget on any device.
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9  # vLLM's name and default
    num_blocks: int | None = None  # overrides the memory budget when set (tests)
    enable_prefix_caching: bool = True
    max_cached_blocks: int | None = None  # unreferenced cached blocks kept at most (None: no cap)
    # Models with recurrent layers: the state pool's slots at most (None: one per running
    # sequence, max_num_seqs, as the memory budget allows). Only paged requests hold one.
    max_recurrent_slots: int | None = None
    # Models with recurrent layers cache prefixes with the state at their end (a checkpoint
    # slot of the state pool, see kv/state_checkpoints.py): one every this many tokens (a
    # multiple of block_size) and where peers' prompts part; at most `max_state_checkpoints`
    # slots (None: a quarter of the memory budget; 16 with num_blocks set)
    state_checkpoint_stride: int = 512
    max_state_checkpoints: int | None = None
    # The CPU pool's pages faulted in ahead (model/kv_memory.py) instead of a page fault on
    # every first write of a 4 KiB page while serving: "start" adds the faults to start-up,
    # "background" runs them on a thread beside the rest of start-up. `prelude serve` takes
    # "background", run-batch "start"; the offline LLM and tests leave it "off".
    populate_kv: Populate = "off"


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the queue-order policies (see engine/policies/)."""

    srpt_starvation_s: float = 10.0
    mlfq_quanta: tuple[int, ...] = (25, 50, 100, 200, 400)
    mlfq_starvation_steps: int = 200
    laps_boundary: int | None = 256  # None: fitted at run time from measured step times
    laps_long_chunk: int = 512
    laps_deadline_free: bool = False
    # LAPS wait-depth targets; the engine sets the executor's CUDA-graph batch sizes here.
    depth_buckets: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """Explicit budgets of one scheduler step; the policy only orders work."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length (capped by the KV pool)
    policy: str = "fcfs"
    # OneShot admission: prompt tokens per step and a temporary-activation estimate.
    max_oneshot_tokens: int | None = None  # None: max_num_batched_tokens
    oneshot_activation_bytes: int = 1 << 30
    force_paged: bool = False  # ablation: send every request down the Paged path
    # OneShot rows ride in the Decode/Mixed forward when budgets allow (fused steps);
    # False: steps alternate between a OneShot batch and a Decode/Mixed batch.
    fuse_oneshot: bool = True
    prefix_deferral: bool = True  # peers of a cold shared prefix wait one step for its leader
    # OneShot peers of a leader in the same step ride in its forward instead (they read the
    # prefix blocks it writes; needs prefix_deferral's leaders); False: they wait the step
    prefix_riders: bool = True
    # A OneShot-only step waits for the rest of a burst of arrivals it expects (the answers
    # of its last step coming back, engine/oneshot_gather.py), at most this long and 5% of
    # that step's duration; 0: never waits.
    oneshot_gather_ms: float = 250.0
    max_decode_batch: int | None = None  # decode slots per step (None: every running sequence)
    # Low-priority requests (/v1/batches lines) yield to normal ones: while a normal prompt
    # waits they get no prompt tokens, and while normal requests run (and `normal_linger_s`
    # after) at most this many a step (the step an arriving interactive request may find
    # in flight stays short). None: no bound.
    low_priority_step_tokens: int | None = 128
    normal_linger_s: float = 0.5
    # After a step with normal rows, low-priority work waits this long for the next normal
    # request (a closed-loop client sends it as soon as its answer is out), which then
    # finds no low-priority step in flight. Only while a bound is set.
    normal_return_s: float = 0.05
    default_ttft_slo_ms: float | None = None  # TTFT target of requests that name none
    # Distinct LoRA adapters one step may hold: the executor's resident slots (--max-loras);
    # the engine sets it from LoraConfig.
    max_loras: int = 0
    policy_options: PolicyConfig = field(default_factory=PolicyConfig)


@dataclass(frozen=True)
class ExecutorConfig:
    """Where and how the model runs; the executor resolves `auto` against the machine."""

    device: str = "auto"  # auto (CUDA when present) | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on GPU and bf16-native CPUs, else float32) | float32 | bfloat16 | float16 (GPU only)
    attention_backend: str = "auto"  # auto (triton on CUDA when installed, cpu on the CPU, else torch) | torch (any device) | triton (CUDA) | cpu (C kernel)
    enforce_eager: bool = False  # no CUDA graphs
    # Decoders: RMSNorm(+residual), q/k norm + rotary and SiLU*up fused (Triton kernels on CUDA,
    # C kernels for float32 and bfloat16 on an AVX2 CPU)
    fused_kernels: bool = True
    # CPU decoders: in a forward whose heads read only some positions (a prompt's last token,
    # each item's last token), the last layer computes attention, o_proj, the MLP and
    # the final norm for those positions only (K/V still for every token). Rows that read every
    # position (prompt logprobs, mean/cls pooling, sequence logprobs) keep all of theirs (LoRA
    # rows too: the read rows' adapters follow them); CUDA forwards compute every position.
    prune_last_layer: bool = True
    # CPU decoders: off | background (serve eagerly, compile off the request path, swap each
    # compiled shape in when ready) | ahead (compile, or load from the disk cache, before ready)
    compile: str = "off"
    # CPU decoders in bf16: make the projections' packed copies while loading, not on their
    # first calls (every bf16 call past the few-row routes takes one, so any prompt makes
    # them all): amx_gemm.c's before ready, oneDNN's on a thread (model.make_packed_copies);
    # a serving engine's first prompt then does not pay for the reorders.
    pack_at_start: bool = False
    # CPU decoders: one GEMM route for every row count (model.make_batch_invariant), so a
    # request's greedy tokens do not depend on what shares its steps (run-batch's default:
    # a resumed job repeats a clean run's answers); the few-row decode routes are given up.
    batch_invariant: bool = False


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA: `max_loras` adapters resident on the device at once (LRU, reloaded
    from disk on demand), each of rank at most `max_lora_rank`."""

    max_loras: int = 4
    max_lora_rank: int = 16


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path to a HF dir or a .gguf file; None = embedded default
    served_model_name: str | None = None
    seed: int = 0
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    # Overlap: while step N is in flight, step N+1 is scheduled around it and launched, and
    # only then is N post-processed (Scheduler.schedule(in_flight=...) decides): N's sampling
    # requests get carried rows, decode rows one position further whose input tokens are
    # copied from N's sampled ids on the device; rows needing the token on the host (grammar, penalties)
    # wait a step; new prompts and OneShot rows go as usual. None: on with CUDA.
    overlap: bool | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig | None = None  # None: no adapters (no slots, the plain forward)
    # JSON fields replacing config.json's at load (vLLM's --hf-overrides): Matryoshka sizes,
    # a reranker's classifier_from_token, ...
    hf_overrides: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
