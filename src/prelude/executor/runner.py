"""ModelRunner.execute(ForwardBatch) -> BatchOutput: tensors in, sampled tokens out."""

from __future__ import annotations

import torch

from prelude.engine.batch import BatchOutput, BatchRow, ForwardBatch, SampleSpec
from prelude.executor.sampler import sample
from prelude.model.attention.metadata import AttentionMetadata, DecodeRows, PrefillSlice
from prelude.model.llama import LlamaForCausalLM


class ModelRunner:
    """Owns the model and its paged KV tensors; knows nothing of requests' lifecycles."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)

    def _slots(self, row: BatchRow) -> list[int]:
        bs = self.block_size
        table = row.block_table
        return [table[p // bs] * bs + p % bs for p in range(row.start_pos, row.start_pos + len(row.token_ids))]

    def build_metadata(self, rows: tuple[BatchRow, ...]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten rows into input ids, positions, attention metadata, and last-token indices."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSlice] = []
        dec_index: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        last_index: list[int] = []
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
            last_index.append(start + n - 1)
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
        return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta, last_index

    def forward_rows(self, rows: tuple[BatchRow, ...]) -> tuple[torch.Tensor, list[int]]:
        """Run the trunk; returns hidden states [T, H] and each row's last-token index."""
        ids, positions, meta, last_index = self.build_metadata(rows)
        hidden = self.model.forward(ids, positions, meta, self.kv_caches)
        return hidden, last_index

    def execute(self, batch: ForwardBatch) -> BatchOutput:
        rows = batch.rows
        hidden, last_index = self.forward_rows(rows)
        wanted = [(row, idx) for row, idx in zip(rows, last_index) if row.sample is not None]
        if not wanted:
            return BatchOutput(sampled={})
        logits = self.model.compute_logits(hidden[torch.tensor([idx for _, idx in wanted], dtype=torch.long)])
        specs: list[SampleSpec] = [row.sample for row, _ in wanted]  # type: ignore[misc]
        tokens = sample(logits, specs)
        return BatchOutput(sampled={row.request_id: tok for (row, _), tok in zip(wanted, tokens)})
