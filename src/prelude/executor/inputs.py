"""A step's integer inputs, flattened on the host and copied to the device once.

Rows (paged prompt chunks and decode rows, OneShot prompts) become `RowLayout`s, host
lists of ids, positions, KV slots and block tables; `InputBuilder.flatten` lays them
into one int64 buffer (pinned on CUDA), copies it non-blocking and hands out aligned
views as the forward's `StepInputs` and attention metadata.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

import torch

from prelude.forward_batch import BatchRow, OneShotRow
from prelude.model.attention.metadata import (
    AttentionMetadata,
    DecodeRows,
    PrefillSlice,
    PrefillTensors,
    StateRow,
    StateRows,
)

_ALIGN = 2  # int64 values: every view starts on a 16-byte boundary
_PAD = (0,) * _ALIGN


def copy_int64(device: torch.device, *parts: Sequence[int]) -> list[torch.Tensor]:
    """Copy several int lists to the device in one transfer; returns one view per list.
    Each view starts 16-byte aligned: Triton specializes kernels on a pointer's 16-byte
    alignment, so an odd offset would compile another variant mid-request (a pause of about a second)
    instead of reusing the one compiled for the graphs' static buffers.

    The values go through an `array('q')` and `torch.frombuffer` (which keeps the array
    alive): `torch.tensor` of a Python list converts element by element, several times
    slower for a prompt's ids and positions."""
    buf = array("q")
    spans: list[tuple[int, int]] = []
    for p in parts:
        start = len(buf)
        buf.extend(p)
        n = len(buf) - start
        spans.append((start, n))
        if n % _ALIGN:
            buf.extend(_PAD[: _ALIGN - n % _ALIGN])
    host = torch.frombuffer(buf, dtype=torch.long) if buf else torch.zeros(0, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    return [flat[start : start + n] for start, n in spans]


@dataclass(frozen=True)
class StepInputs:
    """A forward's device inputs and where each row starts in the flattened batch."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    starts: list[int]
    token_type_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class RowLayout:
    """Host-side description of one row before the single copy to the device."""

    ids: Sequence[int]
    positions: Sequence[int]
    slots: Sequence[int]  # -1: K/V not kept
    block_table: Sequence[int]
    context_len: int
    own_kv_in_cache: bool
    decode: bool
    segments: Sequence[int] | None = None  # per new token; None: one plain causal row
    # Recurrent layers: the state slot the row continues (-1: this forward's scratch) and
    # whether its sequence starts here (a zero state)
    state_slot: int = -1
    fresh: bool = True
    # A prefix hit's checkpoint to start from (-1: none), and the checkpoints to write:
    # (tokens into the row, checkpoint slot)
    restore: int = -1
    saves: tuple[tuple[int, int], ...] = ()


class InputBuilder:
    """Packs rows into a forward's device inputs for one runner's device and block size."""

    def __init__(self, device: torch.device, block_size: int, is_encoder: bool, recurrent: bool = False) -> None:
        self.device = device
        self.block_size = block_size
        self.is_encoder = is_encoder
        self.recurrent = recurrent  # the model has recurrent layers: say each row's state (StateRows)

    def flatten(self, layouts: list[RowLayout], write_kv: bool) -> StepInputs:
        """Flatten rows into device inputs with one host-to-device copy."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[int] = []
        table_spans: list[tuple[int, int]] = []
        starts: list[int] = []
        dec_index: list[int] = []
        dec_lens: list[int] = []
        dec_tables: list[Sequence[int]] = []
        segmented = any(lay.segments is not None for lay in layouts)
        segments: list[int] = []
        for lay in layouts:
            start = len(ids)
            starts.append(start)
            ids.extend(lay.ids)
            positions.extend(lay.positions)
            slots.extend(lay.slots)
            if segmented:
                segments.extend(lay.segments if lay.segments is not None else [0] * len(lay.ids))
            if lay.decode:
                dec_index.append(start)
                dec_lens.append(lay.context_len)
                dec_tables.append(lay.block_table)
            else:
                table_spans.append((len(tables), len(lay.block_table)))
                tables.extend(lay.block_table)
        width = max((len(t) for t in dec_tables), default=0)
        padded = [b for t in dec_tables for b in (*t, *([0] * (width - len(t))))]
        # max/min run in C: a OneShot row's 128 slots are all -1, a decode row's all kept.
        any_kept = write_kv and max(slots, default=-1) >= 0
        all_kept = any_kept and min(slots) >= 0
        kept = [i for i, s in enumerate(slots) if s >= 0] if any_kept and not all_kept else []
        pre = [(start, lay) for lay, start in zip(layouts, starts) if not lay.decode]
        pre_width = max((len(lay.block_table) for _, lay in pre), default=0)
        pre_columns = ([start for start, _ in pre], [len(lay.ids) for _, lay in pre],
                       [lay.context_len for _, lay in pre], [int(lay.own_kv_in_cache) for _, lay in pre])
        pre_tables = [b for _, lay in pre for b in (*lay.block_table, *([0] * (pre_width - len(lay.block_table))))]
        (d_ids, d_pos, d_slots, d_tables, d_dec_index, d_dec_tables, d_dec_lens, d_kept, *d_pre, d_pre_tables,
         d_segments) = copy_int64(
            self.device, ids, positions, slots if any_kept else [], tables, dec_index, padded, dec_lens,
            kept, *pre_columns, pre_tables, segments,
        )
        prefills = []
        span = iter(table_spans)
        for lay, start in zip(layouts, starts):
            if lay.decode:
                continue
            off, n = next(span)
            prefills.append(PrefillSlice(start, len(lay.ids), lay.context_len, d_tables[off : off + n],
                                         own_kv_in_cache=lay.own_kv_in_cache, segmented=lay.segments is not None))
        decodes = None
        if dec_index:
            decodes = DecodeRows(
                query_index=d_dec_index,
                block_tables=d_dec_tables.view(len(dec_index), width),
                context_lens=d_dec_lens,
                max_context_len=max(dec_lens),
            )
        prefill_tensors = None
        if pre:
            prefill_tensors = PrefillTensors(*d_pre, d_pre_tables.view(len(pre), pre_width),
                                             max_query_len=max(len(lay.ids) for _, lay in pre))
        meta = AttentionMetadata(
            slot_mapping=d_slots if any_kept else None,
            prefills=tuple(prefills),
            decodes=decodes,
            block_size=self.block_size,
            kept_tokens=None if all_kept or not any_kept else d_kept,
            prefill_tensors=prefill_tensors,
            segment_ids=d_segments if segmented else None,
            states=self._state_rows(layouts, starts) if self.recurrent else None,
        )
        return StepInputs(d_ids, d_pos, meta, starts)

    def _state_rows(self, layouts: Sequence[RowLayout], starts: Sequence[int]) -> StateRows:
        """Decode rows continuing a slot go in one batch; every other row on its own."""
        rows: list[StateRow] = []
        step_tokens: list[int] = []
        step_slots: list[int] = []
        step_saves: list[tuple[int, int]] = []
        for lay, start in zip(layouts, starts):
            if lay.segments is not None:  # packed items: the run lengths of segments 1, 2, ...
                items = [0] * max(lay.segments)
                for seg in lay.segments:
                    if seg:
                        items[seg - 1] += 1
                rows.append(StateRow(start, len(lay.ids), lay.state_slot, lay.fresh, tuple(items), lay.restore,
                                     lay.saves))
            elif len(lay.ids) == 1 and lay.state_slot >= 0 and not lay.fresh and lay.restore < 0:
                step_tokens.append(start)
                step_slots.append(lay.state_slot)
                step_saves.extend((lay.state_slot, slot) for _, slot in lay.saves)
            else:
                rows.append(StateRow(start, len(lay.ids), lay.state_slot, lay.fresh, (), lay.restore, lay.saves))
        if not step_tokens:
            return StateRows(tuple(rows))
        d_tokens, d_slots = copy_int64(self.device, step_tokens, step_slots)
        return StateRows(tuple(rows), d_tokens, d_slots, tuple(step_saves))

    def paged_layout(self, row: BatchRow) -> RowLayout:
        bs = self.block_size
        n = len(row.token_ids)
        context_len = row.start_pos + n
        table = row.block_table
        slots = [table[p // bs] * bs + p % bs for p in range(row.start_pos, context_len)]
        nb = (context_len + bs - 1) // bs
        return RowLayout(row.token_ids, range(row.start_pos, context_len), slots,
                          table if n == 1 else table[:nb], context_len, True, decode=n == 1,
                          state_slot=-1 if row.state_slot is None else row.state_slot, fresh=row.start_pos == 0,
                          restore=-1 if row.restore_slot is None else row.restore_slot,
                          saves=tuple((p - row.start_pos, slot) for p, slot in row.state_saves))

    def oneshot_layout(self, r: OneShotRow) -> RowLayout:
        """A prompt suffix after its cached prefix; only the blocks it publishes are written."""
        bs = self.block_size
        n = len(r.token_ids)
        first = r.num_cached // bs  # the first published block (a hit may end inside it: copy_from)
        published_end = (first + len(r.publish_blocks)) * bs
        slots: list[int] = []
        for i, block in enumerate(r.publish_blocks):  # a range per block, not a Python iteration per token
            start = (first + i) * bs
            lo, hi = max(start, r.num_cached), min(start + bs, n)
            slots.extend(range(block * bs + lo - start, block * bs + hi - start))
        slots.extend([-1] * (n - max(published_end, r.num_cached)))  # past the published blocks: no K/V kept
        table = (*r.prefix_blocks, *r.publish_blocks) if r.prefix_blocks or r.copy_from is not None else ()
        if self.recurrent and r.num_cached and r.restore_slot is None:
            raise ValueError("a OneShot row of a model with recurrent layers starts after a cached prefix only "
                             "from its state checkpoint")
        state = dict(fresh=r.num_cached == 0, restore=-1 if r.restore_slot is None else r.restore_slot,
                     saves=tuple((p - r.num_cached, slot) for p, slot in r.state_saves))
        if not r.item_lens:
            return RowLayout(r.token_ids[r.num_cached :], range(r.num_cached, n), slots, table, n, False, decode=False,
                             **state)  # type: ignore[arg-type]
        # Multi-item prompts: each item restarts at the shared part's end and is its own segment.
        shared = r.shared_len
        assert r.num_cached <= shared and published_end <= shared, "only the shared part is cached"
        positions = list(range(r.num_cached, shared))
        segments = [0] * (shared - r.num_cached)
        for i, length in enumerate(r.item_lens, start=1):
            positions.extend(range(shared, shared + length))
            segments.extend([i] * length)
        return RowLayout(r.token_ids[r.num_cached :], positions, slots, table, n, False, decode=False,
                          segments=segments, **state)  # type: ignore[arg-type]

    def paged(self, rows: Sequence[BatchRow]) -> StepInputs:
        return self.flatten([self.paged_layout(r) for r in rows], write_kv=True)

    def fused(self, paged: Sequence[BatchRow], oneshot: Sequence[OneShotRow]) -> StepInputs:
        """Paged rows, then OneShot rows, in one forward: the paged rows write their K/V
        to their blocks, the OneShot rows only to the blocks they publish (if any)."""
        assert not self.is_encoder, "encoders keep no KV: they have no paged rows"
        layouts = [self.paged_layout(r) for r in paged] + [self.oneshot_layout(r) for r in oneshot]
        return self.flatten(layouts, write_kv=True)

    def oneshot(self, rows: Sequence[OneShotRow]) -> StepInputs:
        inputs = self.flatten([self.oneshot_layout(r) for r in rows], write_kv=True)
        if not self.is_encoder:
            return inputs
        types = [t for r in rows for t in (r.head.pooling.token_type_ids if r.head and r.head.pooling
                                           and r.head.pooling.token_type_ids else [0] * len(r.token_ids))]
        (d_types,) = copy_int64(self.device, types)
        return StepInputs(inputs.input_ids, inputs.positions, inputs.meta, inputs.starts, d_types)
