"""Offline Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Runs the same engine and step loop as the server, synchronously in the caller's thread.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, LoraConfig, SchedulerConfig
from prelude.engine.engine import LLMEngine
from prelude.engine.request import FinishReason, LoraRequest, SamplingParams, TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        fused_kernels: bool = True,
        prune_last_layer: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory_gib: float | None = None,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        policy: str = "fcfs",
        fuse_oneshot: bool = True,
        seed: int = 0,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        engine: LLMEngine | None = None,
        hf_overrides: dict[str, Any] | None = None,
    ) -> None:
        """`max_loras` > 0: that many LoRA adapters resident at once (see `lora`).
        `hf_overrides`: fields replacing the checkpoint's config.json (vLLM's), e.g.
        `{"is_matryoshka": True}`."""
        if engine is None:
            config = EngineConfig(
                model=model,
                hf_overrides=json.dumps(hf_overrides) if hf_overrides else None,
                seed=seed,
                executor=ExecutorConfig(
                    device=device, dtype=dtype, attention_backend=attention_backend, enforce_eager=enforce_eager,
                    fused_kernels=fused_kernels, prune_last_layer=prune_last_layer,
                ),
                cache=CacheConfig(block_size=block_size, kv_cache_memory_gib=kv_cache_memory_gib,
                                  gpu_memory_utilization=gpu_memory_utilization, num_blocks=num_kv_blocks),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=max_model_len, policy=policy, fuse_oneshot=fuse_oneshot,
                    oneshot_gather_ms=0.0,  # every request is handed over before the steps run
                ),
                lora=LoraConfig(max_loras, max_lora_rank) if max_loras > 0 else None,
            )
            engine = LLMEngine.from_config(config)
        self.engine = engine
        self._ids = itertools.count()
        self._lora_ids = itertools.count(1)

    def lora(self, name: str, path: str) -> LoraRequest:
        """A PEFT LoRA adapter to pass to `generate`, checked against the model now
        (raises prelude.model.lora.adapters.LoraError when it does not fit)."""
        lora = LoraRequest(name, str(path), next(self._lora_ids))
        self.engine.check_adapter(lora)
        return lora

    @property
    def tokenizer(self):  # noqa: ANN201 - the Tokenizer protocol
        return self.engine.tokenizer

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        lora: LoraRequest | Sequence[LoraRequest | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (a string or a list of token ids); results in prompt order.
        `lora`: one adapter for all prompts, or one per prompt (None: the base model)."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        results: list[GenerationResult] = []
        owner: dict[str, tuple[int, int]] = {}
        one = replace(params, n=1)
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)  # type: ignore[arg-type]
        if len(loras) != len(prompts):  # type: ignore[arg-type]
            raise ValueError(f"{len(loras)} adapters for {len(prompts)} prompts")  # type: ignore[arg-type]
        for p_idx, prompt in enumerate(prompts):  # type: ignore[arg-type]
            text, ids = self._tokens(prompt)
            result = GenerationResult(prompt=text, prompt_token_ids=ids)
            for i in range(params.n):
                seed = None if params.seed is None else (params.seed + i) % 2**64  # stays a valid seed
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, ids, replace(one, seed=seed), lora=loras[p_idx])
                owner[rid] = (p_idx, i)
                result.outputs.append(CompletionOutput(i, "", [], None, logprobs=[] if params.logprobs is not None else None))
            results.append(result)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                p_idx, i = owner[out.request_id]
                c = results[p_idx].outputs[i]
                c.text += out.text
                c.token_ids.extend(out.new_token_ids)
                if c.logprobs is not None:
                    c.logprobs.extend(out.logprobs)
                if out.finished:
                    assert out.finish_reason is not None and out.finish_reason is not FinishReason.ABORT
                    c.finish_reason = out.finish_reason.value
                    c.stop_reason = out.stop_reason
        return results
