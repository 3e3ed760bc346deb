"""Attention that looks both ways, for encoders: every token of a row sees every token of
that row (a full layer) or those within half a window on either side (a sliding layer of
a bidirectional model). Nothing is cached: every row is a whole OneShot prompt.

The step's rows run as one padded batch, one SDPA a layer, keys past a row's end masked:
rows one by one made N short texts cost N small attention calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prelude.model.attention.metadata import AttentionMetadata

_MIN_CHUNK = 64  # queries a chunk holds at least, under a narrow window


class PaddedRows:
    """The rows of one forward as a padded batch [B, L]: token i of row b sits at b * L + i.
    The masks are made once a forward and shared by every layer of their kind."""

    def __init__(self, meta: AttentionMetadata, device: torch.device) -> None:
        if meta.decodes is not None or any(r.context_len != r.query_len for r in meta.prefills):
            raise ValueError("bidirectional attention takes whole prompts only (no cached prefix, no decode rows)")
        self.lengths = [r.query_len for r in meta.prefills]
        self.batch, self.longest = len(self.lengths), max(self.lengths)
        self.device = device
        # None: every row as long as the longest, the flat tokens are the padded batch already
        self.at: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # [B, 1, 1, L] keys inside their row
        if any(n != self.longest for n in self.lengths):
            self.at = torch.cat([torch.arange(n, device=device) + b * self.longest for b, n in enumerate(self.lengths)])
            lens = torch.tensor(self.lengths, device=device)
            self.valid = (torch.arange(self.longest, device=device)[None, :] < lens[:, None])[:, None, None, :]
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [B, H, L, D] (zeros past each row's end)."""
        if self.at is None:
            return x.reshape(self.batch, self.longest, *x.shape[1:]).transpose(1, 2)
        grid = x.new_zeros(self.batch * self.longest, *x.shape[1:])
        grid.index_copy_(0, self.at, x)
        return grid.view(self.batch, self.longest, *x.shape[1:]).transpose(1, 2)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H, L, D] -> [T, H, D]."""
        flat = out.transpose(1, 2).reshape(self.batch * self.longest, out.shape[1], out.shape[3])
        return flat if self.at is None else flat.index_select(0, self.at)

    def mask(self, radius: int | None) -> torch.Tensor | None:
        """Which keys each query sees: its row's, within `radius` positions where given
        (None: no mask needed). A padded query sees every key, so that no softmax row is
        empty; its output is dropped."""
        if radius not in self._masks:
            near = None
            if radius is not None and radius + 1 < self.longest:
                pos = torch.arange(self.longest, device=self.device)
                near = ((pos[:, None] - pos[None, :]).abs() <= radius)[None, None]  # [1, 1, L, L]
            if self.valid is None:
                self._masks[radius] = near
            else:
                padded_query = ~self.valid.transpose(-1, -2)  # [B, 1, L, 1]
                keys = self.valid if near is None else near & self.valid
                self._masks[radius] = keys | padded_query
        return self._masks[radius]


    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               radius: int | None) -> torch.Tensor:
        """Padded [B, H, L, D] attention, keys within `radius` where given. Rows much longer
        than their window run in query chunks, each over the keys its window can reach:
        a 2,048-token row under a 256-token radius computes 3/8 of the scores."""
        mask, gqa = self.mask(radius), q.shape[1] != k.shape[1]
        chunk = max(_MIN_CHUNK, radius or 0)
        if radius is None or 2 * (chunk + 2 * radius) > self.longest:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        assert mask is not None
        out = torch.empty_like(q)
        for start in range(0, self.longest, chunk):
            end = min(self.longest, start + chunk)
            lo, hi = max(0, start - radius), min(self.longest, end + radius)
            out[:, :, start:end] = F.scaled_dot_product_attention(
                q[:, :, start:end], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask[..., start:end, lo:hi],
                scale=scale, enable_gqa=gqa)
        return out


class BidirectionalAttention:
    """The attention backend interface without a cache: attend, return [T, Hq, D]."""

    name = "bidirectional"
    reads_prefill_tensors = False

    def __init__(self) -> None:
        self._rows: tuple[AttentionMetadata, PaddedRows] | None = None  # the current forward's layout

    def rows(self, meta: AttentionMetadata, device: torch.device) -> PaddedRows:
        if self._rows is None or self._rows[0] is not meta:
            self._rows = (meta, PaddedRows(meta, device))
        return self._rows[1]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """`k_cache`, `v_cache`: not read (nothing is kept). `window`: a sliding layer's span,
        centred on the query: it sees `window // 2` positions on either side (transformers'
        bidirectional Gemma 3: |i - j| < window // 2 + 1); None: its whole row."""
        rows = self.rows(meta, q.device)
        return rows.unpad(rows.attend(rows.pad(q), rows.pad(k), rows.pad(v), scale,
                                      None if window is None else window // 2))
