"""Turn last-token logits into next tokens on the logits' device: penalties, temperature,
top-k/p, min-p and per-request seeds, with one device-to-host copy per step (shared with the heads' results, see host_copy.py).

Randomness is a counter-based hash of (request seed, output position, token id), not a
stateful generator: a row's draw depends on nothing else in the batch, so answers are
reproducible on any device, in any batch, eager or replayed from a CUDA graph. A token
is drawn by the exponential race (argmax of p_i / E_i with E_i ~ Exp(1)), which samples
exactly from p without a data-dependent multinomial.

Logprobs are reported from the raw model distribution (before penalties and
temperature), as vLLM and OpenAI do.

On the CPU the argmaxes and the race run in a small C kernel (row_argmax.py: the same
tokens, without the [rows, vocab] noise), and top-k / top-p look at each row's best
TRUNCATE_PREFIX tokens before sorting a whole row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from prelude.executor.host_copy import HostCopy
from prelude.kernels.cpu.row_argmax import race_argmax, row_argmax
from prelude.forward_batch import SampledToken, SampleSpec
from prelude.model.layers.heads import ordered_topk
from prelude.params import TokenLogprob


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_POS = _i64(0xD6E8FEB86659FD93)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64 on every torch device, as the mixer needs.
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] float64 uniforms in (0, 1), a pure function of (seed, position, token id)."""
    row = _splitmix(seeds * _GOLDEN + positions * _POS)
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _splitmix(row.unsqueeze(1) + (tokens.unsqueeze(0) + 1) * _GOLDEN)
    return (_shr(x, 11).to(torch.float64) + 0.5) * 2.0**-53


@dataclass(frozen=True)
class _RowParams:
    """Per-row sampling parameters as device tensors, built once per call."""

    temperature: torch.Tensor  # [R] float32 (0 rows are greedy)
    top_k: torch.Tensor  # [R] int64, vocab = off
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64: output position of the token being drawn
    greedy: torch.Tensor  # [R] bool


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _to_device_tensor(torch.tensor(values, dtype=dtype), device)


def _to_device_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _row_params(specs: Sequence[SampleSpec], vocab: int, device: torch.device) -> _RowParams:
    """Two host-to-device copies (float and integer columns), not one per parameter."""
    floats = torch.tensor([[0.0 if s.params.greedy else s.params.temperature for s in specs],
                           [s.params.top_p for s in specs], [s.params.min_p for s in specs]], dtype=torch.float32)
    ints = torch.tensor([[s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in specs],
                         [s.seed for s in specs], [s.position for s in specs],
                         [int(s.params.greedy) for s in specs]], dtype=torch.int64)
    f, i = _to_device_tensor(floats, device), _to_device_tensor(ints, device)
    return _RowParams(temperature=f[0], top_k=i[0], top_p=f[1], min_p=f[2], seeds=i[1], positions=i[2],
                      greedy=i[3] != 0)


def _apply_penalties(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """Repetition, presence and frequency penalties as scatters over [R, V]."""
    device = logits.device
    rep_rows = [i for i, s in enumerate(specs) if s.params.repetition_penalty != 1.0]
    if rep_rows:
        rows: list[int] = []
        toks: list[int] = []
        for i in rep_rows:
            seen = set(specs[i].prompt_token_ids) | set(specs[i].output_token_ids)
            rows.extend([i] * len(seen))
            toks.extend(seen)
        seen_mask = torch.zeros_like(logits, dtype=torch.bool)
        seen_mask[_to_device(rows, torch.int64, device), _to_device(toks, torch.int64, device)] = True
        penalty = _to_device([s.params.repetition_penalty for s in specs], torch.float32, device).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen_mask, penalized, logits)
    add_rows = [i for i, s in enumerate(specs) if (s.params.presence_penalty or s.params.frequency_penalty)
                and s.output_token_ids]
    if add_rows:
        rows = [i for i in add_rows for _ in specs[i].output_token_ids]
        toks = [t for i in add_rows for t in specs[i].output_token_ids]
        counts = torch.zeros_like(logits)
        counts.index_put_(
            (_to_device(rows, torch.int64, device), _to_device(toks, torch.int64, device)),
            torch.ones(len(toks), dtype=logits.dtype, device=device), accumulate=True,
        )
        freq = _to_device([s.params.frequency_penalty for s in specs], torch.float32, device).unsqueeze(1)
        pres = _to_device([s.params.presence_penalty for s in specs], torch.float32, device).unsqueeze(1)
        logits = logits - freq * counts - pres * (counts > 0).to(logits.dtype)
    return logits


# On the CPU a full sort of a vocabulary-wide row is costly, while the tokens top-k / top-p
# keep are almost always among a row's best few hundred: CPU steps first try that prefix (a
# partial top-k, far cheaper) and sort only when it falls short.
TRUNCATE_PREFIX = 256


def _prefix_probs(logits: torch.Tensor, p: _RowParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's best TRUNCATE_PREFIX tokens in descending order, with their probabilities
    after top-k (the softmax over the top-k-masked whole row): (probs, token ids), or None
    when some sampled row may keep a token past the prefix (top-k does not cut inside it
    and its mass stays below top_p). Reads the result on the host: CPU only."""
    vals, order = logits.topk(TRUNCATE_PREFIX, dim=-1)
    ranks = torch.arange(TRUNCATE_PREFIX, device=logits.device).unsqueeze(0)
    cut = p.top_k <= TRUNCATE_PREFIX
    kept = (vals.masked_fill(ranks >= p.top_k.unsqueeze(1), float("-inf")) - vals[:, :1]).exp()
    whole_row = (logits - vals[:, :1]).exp().sum(-1)
    probs = kept / torch.where(cut, kept.sum(-1), whole_row).unsqueeze(1)
    if not bool((cut | p.greedy | (probs.sum(-1) >= p.top_p)).all()):
        return None
    return probs, order


def _filtered_probs(logits: torch.Tensor, p: _RowParams, truncate: bool, use_min_p: bool) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as masks; all rows at once, no host sync
    on a GPU. `truncate` / `use_min_p` come from the requests' parameters (host knowledge),
    so the sort is skipped when no row asks for top-k or top-p."""
    vocab = logits.shape[1]
    logits = logits / p.temperature.clamp_min(1e-5).unsqueeze(1)
    if not truncate:
        probs = logits.softmax(-1)
    else:
        found = _prefix_probs(logits, p) if logits.device.type == "cpu" and vocab > TRUNCATE_PREFIX else None
        if found is not None:
            sorted_probs, order = found
            remove = torch.arange(TRUNCATE_PREFIX, device=logits.device).unsqueeze(0) >= p.top_k.unsqueeze(1)
        else:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            remove = torch.arange(vocab, device=logits.device).unsqueeze(0) >= p.top_k.unsqueeze(1)
            sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
        # Drop a token once the mass before it already reaches top_p (the best token always stays).
        remove |= (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p.unsqueeze(1)
        probs = torch.zeros_like(logits).scatter(1, order, sorted_probs.masked_fill(remove, 0.0))
    if use_min_p:
        probs = probs.masked_fill(probs < probs.amax(-1, keepdim=True) * p.min_p.unsqueeze(1), 0.0)
    return probs


def allowed_tokens(bitmasks: np.ndarray, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmasks (bit i of word w: token 32w + i) -> [R, vocab] bool, unpacked
    on the host (numpy's unpackbits: much faster than shifting int32 tensors here)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmasks).view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].view(np.bool_))


def _apply_token_masks(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """Structured outputs: tokens outside a row's grammar mask get -inf (a new tensor:
    the raw logits still give the reported logprobs)."""
    rows = [i for i, s in enumerate(specs) if s.token_bitmask is not None]
    if not rows:
        return logits
    index = _to_device(rows, torch.int64, logits.device)
    allowed = _to_device_tensor(allowed_tokens(np.stack([specs[i].token_bitmask for i in rows]), logits.shape[1]),
                                logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)


class DeferredSample:
    """Sampled tokens queued on the device: `token_ids` [R] stays there (a carried row
    reads its input from it), calling it reads the host copy once it has landed."""

    def __init__(self, token_ids: torch.Tensor, build: Callable[[], list[SampledToken]]) -> None:
        self.token_ids = token_ids
        self._build = build

    def __call__(self) -> list[SampledToken]:
        return self._build()


def argmax_only(spec: SampleSpec) -> bool:
    """Whether a row's token is its logits' argmax and nothing else reads them: greedy, no
    logprobs, penalties or grammar mask (a model's head may then find the argmax itself)."""
    p = spec.params
    return (p.greedy and p.logprobs is None and spec.token_bitmask is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty)


def chosen_deferred(chosen: torch.Tensor, copy: HostCopy) -> DeferredSample:
    """Tokens already chosen (int64 [R] on the device) queued on `copy`, as `sample_deferred`
    queues an argmax-only step's."""
    ids = copy.add(chosen)
    return DeferredSample(chosen, lambda: [SampledToken(token_id=int(t), logprob=None) for t in ids.get()])


def sample_deferred(logits: torch.Tensor, specs: Sequence[SampleSpec], copy: HostCopy) -> DeferredSample:
    """Queue the sampling of `logits` (float32 [R, V], one row per spec) on its device and
    its results on `copy`; the returned builder reads them once the copy has landed."""
    vocab = logits.shape[1]
    work = _apply_token_masks(_apply_penalties(logits, specs), specs)
    chosen = row_argmax(work)
    if not all(s.params.greedy for s in specs):  # greedy-only steps copy no row parameters
        p = _row_params(specs, vocab, logits.device)
        truncate = any(0 < s.params.top_k < vocab or s.params.top_p < 1.0 for s in specs)
        probs = _filtered_probs(work, p, truncate, any(s.params.min_p > 0 for s in specs))
        chosen = torch.where(p.greedy, chosen, race_argmax(probs, p.seeds, p.positions, uniform_noise))
    want_k = [s.params.logprobs for s in specs]
    ids = copy.add(chosen)
    if all(k is None for k in want_k):
        return DeferredSample(chosen, lambda: [SampledToken(token_id=int(t), logprob=None) for t in ids.get()])
    raw = torch.log_softmax(logits, dim=-1)
    k_max = max(k or 0 for k in want_k)
    chosen_lp = copy.add(raw.gather(1, chosen.unsqueeze(1)).squeeze(1))
    # [R, 2k]: ids, values (each row's first k of k_max: one total order, see ordered_topk)
    top = copy.add(torch.cat(ordered_topk(raw, k_max)[::-1], dim=1)) if k_max > 0 else None

    def build() -> list[SampledToken]:
        results: list[SampledToken] = []
        tops = top.get() if top is not None else None
        for i, (tok, lp, k) in enumerate(zip(ids.get(), chosen_lp.get(), want_k)):
            logprob = None
            if k is not None:
                alts = tuple((int(t), v) for t, v in zip(tops[i][:k], tops[i][k_max : k_max + k])) if k else ()  # type: ignore[index]
                logprob = TokenLogprob(token_id=int(tok), logprob=lp, top=alts)
            results.append(SampledToken(token_id=int(tok), logprob=logprob))
        return results

    return DeferredSample(chosen, build)


def sample(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[SampledToken]:
    """Sample now: `sample_deferred` and wait for its one copy."""
    copy = HostCopy()
    build = sample_deferred(logits, specs, copy)
    copy.start()
    return build()
