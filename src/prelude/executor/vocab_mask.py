"""Ids past the tokenizer's table never get sampled.

Qwen-family checkpoints pad the output head (151,936 rows against 151,851 tokenizer
entries) for matmul-friendly shapes. The extra rows carry logits like any other, so
without a mask a sampler can pick an id no tokenizer can spell.
"""

from __future__ import annotations

import torch


def mask_padded_vocab(logits: torch.Tensor, emittable: int | None) -> torch.Tensor:
    """`logits` [R, V] with columns >= `emittable` set to -inf, in place (None: no mask)."""
    if emittable is not None and logits.shape[-1] > emittable:
        with torch.inference_mode():  # the head's logits are inference tensors: no copy needed
            logits[..., emittable:] = float("-inf")
    return logits
