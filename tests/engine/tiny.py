"""A tiny random-weight Llama with a byte-level tokenizer, for engine tests."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, LoraConfig, SchedulerConfig
from prelude.engine.engine import LLMEngine
from prelude.executor.runner import ModelRunner
from prelude.model.registry import config_for

EOS = 256
VOCAB = 260


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is <eos> (special). Multi-byte characters span tokens."""

    vocab_size = VOCAB
    bos_token_id = None
    eos_token_ids = frozenset({EOS})
    chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytearray()
        out = ""
        for i in ids:
            if i < 256:
                data.append(i)
                continue
            out += data.decode("utf-8", errors="replace")
            data = bytearray()
            if not skip_special_tokens:
                out += "<eos>" if i == EOS else f"<special_{i}>"
        return out + data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b"<eos>" if token_id == EOS else b""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


def hf_tiny_llama(seed: int = 0, vocab_size: int = VOCAB) -> Any:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).float().eval()


def hf_tiny_hybrid() -> Any:
    """A tiny random Qwen3.5 (three Gated DeltaNet layers, one gated attention layer)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=24,
        linear_value_head_dim=20, max_position_embeddings=512, eos_token_id=256, tie_word_embeddings=False)
    model = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF initialises the (1 + w) norms at zero: move them off it
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.normal_(0, 0.3)
    return model


def hf_tiny_qwen3(vocab_size: int, seed: int = 0) -> Any:
    """A random-weight Qwen3-shaped model (q/k norm) whose head has `vocab_size` rows."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return transformers.Qwen3ForCausalLM(cfg).float().eval()


def tiny_engine(
    hf_model: Any,
    *,
    num_blocks: int = 128,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int | None = None,
    force_paged: bool = False,
    prefix_caching: bool = True,
    max_cached_blocks: int | None = None,
    attention_backend: str = "torch",
    overlap: bool | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    enforce_eager: bool = False,
    tokenizer: Any = None,
    compile: str = "off",
    fuse_oneshot: bool = True,
    lora: LoraConfig | None = None,
    max_recurrent_slots: int | None = None,
    state_checkpoint_stride: int = 512,
    max_state_checkpoints: int | None = None,
) -> LLMEngine:
    config = config_for(hf_model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    executor = ExecutorConfig(device=device, dtype=dtype, attention_backend=attention_backend,
                              enforce_eager=enforce_eager, compile=compile)
    runner = ModelRunner.create(config, weights, executor, block_size, lora=lora)
    engine_cfg = EngineConfig(
        executor=executor,
        overlap=overlap,
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
            max_cached_blocks=max_cached_blocks, max_recurrent_slots=max_recurrent_slots,
            state_checkpoint_stride=state_checkpoint_stride, max_state_checkpoints=max_state_checkpoints,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            force_paged=force_paged, fuse_oneshot=fuse_oneshot,
        ),
        lora=lora,
    )
    return LLMEngine(runner, tokenizer if tokenizer is not None else ByteTokenizer(), engine_cfg, "tiny-llama")
