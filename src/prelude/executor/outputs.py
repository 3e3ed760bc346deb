"""What a step returns: sampled tokens and head outputs, projected only where a row
asked for them, queued on the device and copied to the host once.

`OutputHeads.launch` queues the last-token logits and sampling (deferred: the sampled ids
stay on the device until the copy), prompt logprobs, pooled embeddings, classifier and
label scores on one `HostCopy`, and returns a `LaunchedStep` whose `wait` builds the
`BatchOutput` once that copy has landed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from prelude.executor import label_heads
from prelude.executor.host_copy import HostCopy, HostValue
from prelude.executor.inputs import copy_int64
from prelude.executor.read_rows import RowRead, local_index
from prelude.executor.sampler import argmax_only, chosen_deferred, sample_deferred
from prelude.executor.vocab_mask import mask_padded_vocab
from prelude.forward_batch import BatchOutput, HeadOutput, HeadSpec, SampleSpec
from prelude.model.layers import heads
from prelude.model.layers.pooler import Pooler, running_pool
from prelude.model.base import Model
from prelude.params import PoolingTask, TokenLogprob


class LaunchedStep:
    """A step queued on the device; `wait` blocks until its one result copy has landed.
    `sampled_ids` [R] are its sampled tokens on the device, row `sampled_rows[request_id]`."""

    def __init__(self, build: Callable[[], BatchOutput], sampled_ids: torch.Tensor | None = None,
                 sampled_rows: dict[str, int] | None = None) -> None:
        self._build = build
        self._result: BatchOutput | None = None
        self.forward_done: float | None = None  # perf_counter when the forward was run (or queued)
        self.heads_heavy = False  # on a CPU, its heads' work at least its trunk's (ModelRunner.heads_outweigh_trunk)
        self.sampled_ids = sampled_ids
        self.sampled_rows = sampled_rows or {}

    def wait(self) -> BatchOutput:
        if self._result is None:
            self._result = self._build()
        return self._result


@dataclass(frozen=True)
class CarriedTokens:
    """Decode overlap: rows whose input token is sampled by `source`, a step still in
    flight. The runner copies them from its `sampled_ids` on the device (no host round
    trip): the next step is launched before this one's results are read."""

    source: LaunchedStep
    request_ids: tuple[str, ...]


class OutputHeads:
    """A model's output projections for one step's rows (the trunk's hidden states in)."""

    def __init__(self, model: Model, pooler: Pooler | None = None, default_pooling: str | None = None) -> None:
        self.model = model
        self.device = model.device
        self.pooler = pooler or Pooler(device=model.device)  # a sentence-transformers folder's Dense layers
        self.default_pooling = default_pooling or model.default_pooling

    def launch(
        self,
        hidden: torch.Tensor,
        starts: list[int],
        rows: list[tuple[str, list[int], SampleSpec | None, HeadSpec | None]],
        emittable_vocab: int | None,
        classify_heads: Mapping[str, torch.Tensor] | None = None,
        reads: Sequence[RowRead] | None = None,
    ) -> LaunchedStep:
        """Project only what each row asked for: last-token logits, prompt logprobs, heads.
        `reads`: when the forward returned only the positions read (executor/read_rows.py),
        each row's read positions; `starts` are then the rows' starts among those."""
        copy = HostCopy()
        read: Sequence[RowRead] = reads if reads is not None else [None] * len(rows)
        want = [(rid, starts[i] + local_index(read[i], len(tok) - 1), spec)
                for i, (rid, tok, spec, _) in enumerate(rows) if spec is not None]
        sampled_build = None
        if want:
            (index,) = copy_int64(self.device, [idx for _, idx, _ in want])
            picked, specs = hidden.index_select(0, index), [s for _, _, s in want]
            chosen = self.model.greedy_token_ids(picked, emittable_vocab) if all(map(argmax_only, specs)) else None
            if chosen is not None:
                sampled_build = chosen_deferred(chosen, copy)
            else:
                logits = mask_padded_vocab(self.model.compute_logits(picked), emittable_vocab)
                sampled_build = sample_deferred(logits, specs, copy)
        own = classify_heads or {}  # rows whose LoRA adapter brings its own classification head
        head_builds = {rid: self._head(hidden[starts[i] : starts[i] + _width(read[i], len(tokens))], tokens, head, copy,
                                   own.get(rid), read[i])
                   for i, (rid, tokens, _, head) in enumerate(rows) if head is not None}
        copy.start()

        def build() -> BatchOutput:
            sampled = dict(zip([rid for rid, _, _ in want], sampled_build())) if sampled_build else {}
            return BatchOutput(sampled=sampled, heads={rid: b() for rid, b in head_builds.items()})

        return LaunchedStep(build, sampled_build.token_ids if sampled_build else None,
                            {rid: i for i, (rid, _, _) in enumerate(want)})

    def _head(self, hidden: torch.Tensor, tokens: list[int], head: HeadSpec, copy: HostCopy,  # noqa: ANN202
              classify_head: torch.Tensor | None = None, read: RowRead = None):
        """Queue a row's head tensors on `copy`; returns a builder run after the copy.
        `hidden`: the row's read positions `read` (None: all, one per token)."""
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
        pooled: HostValue | None = None
        before = (None if head.pooled_before is None else
                  torch.tensor(head.pooled_before, dtype=torch.float32).to(self.device, non_blocking=True))
        if p is not None and p.task is PoolingTask.LABELS:
            rows_at, label_ids = copy_int64(self.device, [local_index(read, j) for j in label_heads.score_rows(
                len(tokens), p)], p.label_token_ids)
            scores = copy.add(label_heads.label_scores(
                hidden.index_select(0, rows_at), label_ids, p.label_softmax,
                self.model.compute_logits, self.model.compute_label_logits,
            ).reshape(-1))
        elif p is not None and p.task is PoolingTask.SEQUENCE_LOGPROBS:
            predictors, targets = label_heads.sequence_rows(tokens, p.item_lens)
            rows_at, d_targets = copy_int64(self.device, predictors, targets)
            scores = copy.add(label_heads.sequence_logprobs(
                hidden.index_select(0, rows_at), d_targets, p.item_lens, self.model.compute_logits))
        elif p is not None and p.task is PoolingTask.CLASSIFY:
            scores = copy.add(self.model.classify(hidden) if classify_head is None
                              else F.linear(hidden[-1], classify_head).float())
        elif p is not None and head.pool_chunk:
            pooled = copy.add(running_pool(hidden, p.skip_tokens, before))
        elif p is not None:
            embedding = copy.add(self.pooler(hidden, p.pooling or self.default_pooling, p.skip_tokens, p.dimensions,
                                             p.normalize, before))

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
                pooled=pooled.get() if pooled is not None else None,
            )

        return build


def _width(read: RowRead, num_tokens: int) -> int:
    """A row's rows in the forward's output."""
    return num_tokens if read is None else len(read)
