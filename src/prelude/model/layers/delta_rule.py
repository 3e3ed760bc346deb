"""The gated delta rule (Gated DeltaNet's recurrence) and its causal depthwise conv, in
torch: a chunked form for prompts (a Python step per chunk of 64 tokens, none per token)
and a one-token form for decode that updates a batch of states in place. The layer runs
them where neither the C kernels (kernels/cpu/delta_rule.c, the CPU) nor
flash-linear-attention (CUDA) serve.

The recurrence, per value head, with S [k_dim, v_dim] float32:
    S = exp(g_t) * S;  S = S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T q_t
q and k are L2-normalised and q scaled by k_dim ** -0.5. The chunked form is the same sum
regrouped (the WY/UT representation of the DeltaNet paper): within a chunk the rank-one
updates are solved as one unit-lower-triangular system, across chunks the state carries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
# Decays below exp(-60) are taken as 0: their terms are ~1e-26 of the ones they are summed
# with, far below float32's rounding, while exp of -87..-103 gives subnormal floats, whose
# arithmetic is ~100x slower on x86 (a prompt whose decays land there took ~30x longer).
_LOG_ZERO = -60.0


def _decay(log: torch.Tensor) -> torch.Tensor:
    """exp(log), with exp(x) for x < _LOG_ZERO exactly 0."""
    return log.masked_fill(log < _LOG_ZERO, float("-inf")).exp()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_for_values(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """q/k [..., Hk, d] -> [..., Hv, d]: each key head serves Hv / Hk consecutive value heads."""
    n = num_v_heads // x.shape[-2]
    return x if n == 1 else x.repeat_interleave(n, dim=-2)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of equal length: q, k [B, L, Hk, dk]; v [B, L, Hv, dv]; g (log decay, <= 0) and
    beta [B, L, Hv]; state [B, Hv, dk, dv] or None (zeros). q and k are normalised here.
    Returns (output [B, L, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] float32)."""
    out_dtype = v.dtype
    batch, length, _, dk = k.shape
    hv, dv = v.shape[-2:]
    q = l2norm(_heads_for_values(q, hv).float()).transpose(1, 2) * dk**-0.5  # [B, Hv, L, dk]
    k = l2norm(_heads_for_values(k, hv).float()).transpose(1, 2)
    v = v.float().transpose(1, 2)  # [B, Hv, L, dv]
    g = g.float().transpose(1, 2)  # [B, Hv, L]
    beta = beta.float().transpose(1, 2)
    pad = (-length) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (length + pad) // chunk
    q, k, v = (x.reshape(batch, hv, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(batch, hv, n, chunk), beta.reshape(batch, hv, n, chunk)
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # exp(decay_i - decay_j) for j <= i, 0 above the diagonal
    pair = _decay((decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(above, float("-inf")))
    k_beta = k * beta.unsqueeze(-1)
    # (I + strictly-lower(k_beta k^T * pair)) u = beta v: the chunk's updates as one solve
    system = (k_beta @ k.transpose(-1, -2)) * pair
    eye_mask = above.logical_not().tril(-1)
    system = system * eye_mask + torch.eye(chunk, dtype=system.dtype, device=system.device)
    # one solve for both right-hand sides, on contiguous operands (LAPACK copies strided ones)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * _decay(decay).unsqueeze(-1)], dim=-1)
    u, w = torch.linalg.solve_triangular(system.contiguous(), rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    inner = (q @ k.transpose(-1, -2)) * pair  # within-chunk scores, causal incl. the diagonal
    q_decayed = q * _decay(decay).unsqueeze(-1)
    k_to_end = k * _decay(decay[..., -1:] - decay).unsqueeze(-1)
    chunk_decay = _decay(decay[..., -1])[..., None, None]  # [B, Hv, n, 1, 1]
    s = (torch.zeros(batch, hv, dk, dv, dtype=torch.float32, device=q.device) if state is None
         else state.to(torch.float32).clone())
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s  # what the state does not already predict
        out[:, :, i] = q_decayed[:, :, i] @ s + inner[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, hv, n * chunk, dv)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype), s


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor) -> torch.Tensor:
    """One token of B rows: q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; state [B, Hv, dk,
    dv] float32, updated in place. Returns the output [B, Hv, dv] in v's dtype."""
    hv, dk = v.shape[-2], k.shape[-1]
    q = l2norm(_heads_for_values(q, hv).float()) * dk**-0.5
    k = l2norm(_heads_for_values(k, hv).float())
    state.mul_(_decay(g.float())[..., None, None])
    predicted = (state * k.unsqueeze(-1)).sum(-2)  # S^T k: [B, Hv, dv]
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (state * q.unsqueeze(-1)).sum(-2).to(v.dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one row: x [L, C], weight [C, K], state [C, K - 1]
    (the K - 1 inputs before x; None: zeros). Returns (output [L, C], the new state [C, K - 1])."""
    width = weight.shape[1] - 1
    xt = x.transpose(0, 1).to(weight.dtype)  # [C, L]
    before = xt.new_zeros(xt.shape[0], width) if state is None else state.to(weight.dtype)
    full = torch.cat([before, xt], dim=1)  # [C, K - 1 + L]
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0]).squeeze(0)  # [C, L]
    return F.silu(out).transpose(0, 1).to(x.dtype), full[:, full.shape[1] - width:]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token of B rows: x [B, C], state [B, C, K - 1] updated in place. Returns [B, C]."""
    full = torch.cat([state, x.to(state.dtype).unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0]).squeeze(-1)
    state.copy_(full[..., 1:])
    return F.silu(out).to(x.dtype)
