"""The machine's GEMM roofline for a prompt forward: what the CPU's matrix multiply can
do, independent of any serving engine's kernels.

A 512-token prefill of a small decoder is almost all GEMMs (the rest is attention and
pointwise ops), so the best GEMM rate measured at the model's own
layer shapes, divided by a request's FLOPs, bounds the requests/s any engine can reach on
this machine in this dtype. Prelude's own eager forward (bench/ceiling.py) is reported
next to it: it is one engine's kernels, not the machine's limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    intermediate: int
    layers: int
    q_size: int
    kv_size: int
    vocab: int

    @staticmethod
    def of(config: object) -> "DecoderShape":
        c = config
        return DecoderShape(c.hidden_size, c.intermediate_size, c.num_hidden_layers,  # type: ignore[attr-defined]
                            c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,  # type: ignore[attr-defined]
                            c.vocab_size)  # type: ignore[attr-defined]

    def gemms(self, tokens: int) -> list[tuple[int, int, int]]:
        """(M, N, K) of one layer's projections for `tokens` rows."""
        return [(tokens, self.q_size + 2 * self.kv_size, self.hidden), (tokens, self.hidden, self.q_size),
                (tokens, 2 * self.intermediate, self.hidden), (tokens, self.hidden, self.intermediate)]

    def request_flops(self, prompt_tokens: int) -> float:
        """FLOPs of a whole-prompt forward plus one row of LM head (a 1-output request):
        projections, causal attention scores and values, and the last row's logits."""
        proj = sum(2 * m * n * k for m, n, k in self.gemms(prompt_tokens)) * self.layers
        attn = 2 * 2 * self.q_size * prompt_tokens * (prompt_tokens + 1) / 2 * self.layers
        return proj + attn + 2 * self.hidden * self.vocab


def gemm_flops_per_s(shape: DecoderShape, dtype: torch.dtype, tokens: int = 512, iters: int = 5) -> float:
    """Best GEMM rate (FLOP/s) over a layer's projections at `tokens` rows, plain
    torch.mm in `dtype` on this thread's cores: the best of `iters` rounds."""
    mats = [(torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)) for m, n, k in shape.gemms(tokens)]
    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in mats)
    best = float("inf")
    with torch.inference_mode():
        for a, b in mats:  # warm-up: first-call allocations and oneDNN primitive creation
            torch.mm(a, b)
        for _ in range(iters):
            t0 = time.perf_counter()
            for a, b in mats:
                torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    return flops / best


def roofline_req_s(shape: DecoderShape, dtype: torch.dtype, prompt_tokens: int = 512,
                   batch_rows: tuple[int, ...] = (1, 8)) -> tuple[float, float]:
    """(GEMM FLOP/s, requests/s bound) for whole-prompt 1-output requests: the best rate
    over one prompt's rows and a batch of prompts' rows (a server batching requests runs
    taller GEMMs, which can run faster)."""
    rate = max(gemm_flops_per_s(shape, dtype, prompt_tokens * b) for b in batch_rows)
    return rate, rate / shape.request_flops(prompt_tokens)
