"""ModelRunner.execute(ForwardBatch) -> BatchOutput: one path per execution class."""

from __future__ import annotations

import torch

from prelude.engine.batch import (
    BatchOutput,
    BatchRow,
    DecodeBatch,
    ForwardBatch,
    HeadOutput,
    HeadSpec,
    MixedBatch,
    OneShotBatch,
    OneShotRow,
    SampledToken,
    SampleSpec,
)
from prelude.engine.request import PoolingTask, TokenLogprob
from prelude.executor.sampler import sample
from prelude.model import heads
from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillSlice
from prelude.model.encoder import BertEncoder
from prelude.model.llama import LlamaForCausalLM

_EMPTY_TABLE = torch.zeros(0, dtype=torch.long)


class ModelRunner:
    """Owns the model and its paged KV tensors; knows nothing of requests' lifecycles."""

    def __init__(self, model: LlamaForCausalLM | BertEncoder, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)

    # --- paged (Decode / Mixed) -----------------------------------------------------

    def _slots(self, row: BatchRow) -> list[int]:
        bs = self.block_size
        table = row.block_table
        return [table[p // bs] * bs + p % bs for p in range(row.start_pos, row.start_pos + len(row.token_ids))]

    def build_metadata(self, rows: tuple[BatchRow, ...]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten rows into input ids, positions, attention metadata, and row start indices."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSlice] = []
        dec_index: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        starts: list[int] = []
        for row in rows:
            start = len(ids)
            n = len(row.token_ids)
            ids.extend(row.token_ids)
            positions.extend(range(row.start_pos, row.start_pos + n))
            slots.extend(self._slots(row))
            context_len = row.start_pos + n
            if n == 1:
                dec_index.append(start)
                dec_tables.append(row.block_table)
                dec_lens.append(context_len)
            else:
                nb = (context_len + self.block_size - 1) // self.block_size
                table = torch.tensor(row.block_table[:nb], dtype=torch.long)
                prefills.append(PrefillSlice(start, n, context_len, table))
            starts.append(start)
        decodes = None
        if dec_index:
            width = max(len(t) for t in dec_tables)
            padded = torch.zeros(len(dec_tables), width, dtype=torch.long)
            for i, t in enumerate(dec_tables):
                padded[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            decodes = DecodeRows(
                query_index=torch.tensor(dec_index, dtype=torch.long),
                block_tables=padded,
                context_lens=torch.tensor(dec_lens, dtype=torch.long),
                max_context_len=max(dec_lens),
            )
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            prefills=tuple(prefills),
            decodes=decodes,
            block_size=self.block_size,
        )
        return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta, starts

    def forward_rows(self, rows: tuple[BatchRow, ...]) -> tuple[torch.Tensor, list[int]]:
        """Run the trunk on paged rows; returns hidden states [T, H] and each row's start."""
        ids, positions, meta, starts = self.build_metadata(rows)
        return self.model.forward(ids, positions, meta, self.kv_caches), starts

    # --- OneShot: whole prompts, nothing written to the pool -------------------------

    def forward_oneshot(self, rows: list[OneShotRow]) -> tuple[torch.Tensor, list[int]]:
        """Flattened varlen prompt suffixes. A row attends to its cached prefix blocks and
        to its own K/V, which are temporaries except the full blocks it publishes."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[PrefillSlice] = []
        starts: list[int] = []
        bs = self.block_size
        for r in rows:
            n = len(r.token_ids)
            start = len(ids)
            starts.append(start)
            table = torch.tensor(r.prefix_blocks + r.publish_blocks, dtype=torch.long) if r.prefix_blocks else _EMPTY_TABLE
            slices.append(PrefillSlice(start, n - r.num_cached, n, table, own_kv_in_cache=False))
            ids.extend(r.token_ids[r.num_cached :])
            positions.extend(range(r.num_cached, n))
            published_end = r.num_cached + len(r.publish_blocks) * bs
            for p in range(r.num_cached, n):
                slots.append(r.publish_blocks[(p - r.num_cached) // bs] * bs + p % bs if p < published_end else -1)
        slot_mapping = torch.tensor(slots, dtype=torch.long) if any(s >= 0 for s in slots) else None
        meta = AttentionMetadata(slot_mapping=slot_mapping, prefills=tuple(slices), decodes=None, block_size=bs)
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta, self.kv_caches
        )
        return hidden, starts

    # --- one entry point, one path per class ------------------------------------------

    def execute(self, batch: ForwardBatch) -> BatchOutput:
        if isinstance(batch, OneShotBatch):
            if self.model.is_encoder:
                types = [list(r.head.pooling.token_type_ids) if r.head and r.head.pooling and r.head.pooling.token_type_ids
                         else None for r in batch.rows]
                hidden, starts = self.model.forward_rows([r.token_ids for r in batch.rows], types)
            else:
                hidden, starts = self.forward_oneshot(list(batch.rows))
            # Heads see the computed suffix only (prefix-hit rows never need earlier rows).
            rows = [(r.request_id, r.token_ids[r.num_cached :], r.sample, r.head) for r in batch.rows]
        else:
            assert isinstance(batch, (DecodeBatch, MixedBatch))
            hidden, starts = self.forward_rows(batch.rows)
            rows = [(r.request_id, r.token_ids, r.sample, r.head) for r in batch.rows]
        return self._outputs(hidden, starts, rows)

    def _outputs(
        self,
        hidden: torch.Tensor,
        starts: list[int],
        rows: list[tuple[str, list[int], SampleSpec | None, HeadSpec | None]],
    ) -> BatchOutput:
        """Project only what each row asked for: last-token logits, prompt logprobs, heads."""
        sampled: dict[str, SampledToken] = {}
        head_out: dict[str, HeadOutput] = {}
        want = [(rid, starts[i] + len(tok) - 1, spec) for i, (rid, tok, spec, _) in enumerate(rows) if spec is not None]
        if want:
            logits = self.model.compute_logits(hidden[torch.tensor([idx for _, idx, _ in want], dtype=torch.long)])
            for (rid, _, _), tok in zip(want, sample(logits, [s for _, _, s in want])):
                sampled[rid] = tok
        for i, (rid, tokens, _, head) in enumerate(rows):
            if head is not None:
                head_out[rid] = self._head(hidden[starts[i] : starts[i] + len(tokens)], tokens, head)
        return BatchOutput(sampled=sampled, heads=head_out)

    def _head(self, hidden: torch.Tensor, tokens: list[int], head: HeadSpec) -> HeadOutput:
        prompt_lps: list[TokenLogprob | None] | None = None
        if head.prompt_logprobs is not None:
            prompt_lps = [None]
            if len(tokens) > 1:
                actual, rank, vals, ids = heads.prompt_token_logprobs(
                    self.model.compute_logits(hidden[:-1]), tokens, head.prompt_logprobs
                )
                ranks = rank.tolist()
                top_ids = ids.tolist() if ids is not None else None
                top_vals = vals.tolist() if vals is not None else None
                for j, lp in enumerate(actual.tolist()):
                    top = () if top_ids is None else tuple(zip(top_ids[j], top_vals[j]))  # type: ignore[index]
                    prompt_lps.append(TokenLogprob(tokens[j + 1], lp, top, ranks[j]))
        p = head.pooling
        if p is None:
            return HeadOutput(prompt_logprobs=prompt_lps)
        if p.task is PoolingTask.LABELS:
            scores = heads.label_logprobs(self.model.compute_logits(hidden[-1:])[0], p.label_token_ids)
            return HeadOutput(prompt_logprobs=prompt_lps, scores=scores.tolist())
        if p.task is PoolingTask.CLASSIFY:
            return HeadOutput(prompt_logprobs=prompt_lps, scores=self.model.classify(hidden).tolist())
        pooled = heads.pool(hidden, p.pooling or self.model.default_pooling)
        if p.normalize:
            pooled = heads.normalize(pooled)
        return HeadOutput(prompt_logprobs=prompt_lps, embedding=pooled.tolist())
