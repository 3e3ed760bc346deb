"""Block tables of running requests on top of the block pool."""

from __future__ import annotations

from prelude.kv.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class KVCacheManager:
    """Owns the per-request block tables; the scheduler asks it for room."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, total_tokens: int) -> int:
        """Blocks to add so that `total_tokens` tokens of the request have slots."""
        return max(0, blocks_needed(total_tokens, self.block_size) - len(self.block_table(request_id)))

    def allocate(self, request_id: str, total_tokens: int, reserve: int = 0) -> bool:
        """Grow the request's table to cover `total_tokens`; False (and no change) if the
        pool would drop below `reserve` free blocks."""
        need = self.num_new_blocks(request_id, total_tokens)
        if need > self.pool.num_free_blocks - reserve:
            return False
        if need:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(need))
        return True

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            # Released back to front so that a request's tail blocks are reused last.
            self.pool.release(reversed(table))

    def holders(self) -> dict[str, list[int]]:
        return dict(self._tables)

    def check_integrity(self) -> None:
        self.pool.check_integrity(self._tables.values())
