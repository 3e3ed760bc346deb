"""Block-level radix tree over full KV blocks: find cached prefixes, publish new ones.

Each edge is one full block of tokens; a node owns the pool block that holds those
tokens' K/V. Holders pin blocks through the pool's ref counts; unreferenced cached
blocks are evictable, least recently released first. Because requests hold whole
chains (a prefix's blocks in order) and release them tail first, the LRU block is a
leaf in practice; evicting an inner node drops its (equally unreferenced) subtree.

Each namespace has a tree of its own: K/V computed under one LoRA adapter are never
found by a request of another adapter or of the base ("" is the base's namespace).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prelude.kv.block_pool import BlockPool

PARTIAL_SCAN = 64  # children compared for a hit ending inside a block (see PrefixCache.partial)


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    block: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, max_cached_blocks: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_cached_blocks = max_cached_blocks
        self._roots: dict[str, _Node] = {}
        self._by_block: dict[int, _Node] = {}
        self.num_evicted = 0
        pool.set_evictor(self.evict)

    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def _root(self, namespace: str) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), -1, None)
        return root

    def match(self, tokens: list[int], max_blocks: int, namespace: str = "") -> list[int]:
        """Blocks of the longest cached prefix of `tokens`, at most `max_blocks` of them."""
        root = self._roots.get(namespace)
        if root is None:
            return []
        node, blocks = root, []
        for i in range(min(max_blocks, len(tokens) // self.block_size)):
            child = node.children.get(self._key(tokens, i))
            if child is None:
                break
            blocks.append(child.block)
            node = child
        return blocks

    def partial(self, tokens: list[int], matched: list[int], limit: int, namespace: str = "") -> tuple[int, int] | None:
        """After the full blocks `matched` (what `match` returned for `tokens`): the cached
        block whose leading tokens agree longest with `tokens`' next block, up to `limit`
        tokens; (block, tokens agreed) or None. K/V of a token depend only on the tokens
        before it, so those slots of that block are this prompt's too. A node may have
        thousands of children (one per judged item after a rubric): the first
        PARTIAL_SCAN are compared, which share whatever the items' template shares."""
        node = self._by_block.get(matched[-1]) if matched else self._roots.get(namespace)
        if node is None or limit <= 0:
            return None
        start = len(matched) * self.block_size
        want = tokens[start : start + min(limit, self.block_size - 1)]
        best, best_len = -1, 0
        for i, child in enumerate(node.children.values()):
            if i == PARTIAL_SCAN or best_len == len(want):
                break
            n = 0
            while n < len(want) and child.key[n] == want[n]:
                n += 1
            if n > best_len:
                best, best_len = child.block, n
        return (best, best_len) if best_len else None

    def insert(self, tokens: list[int], blocks: list[int], namespace: str = "") -> int:
        """Register `blocks` as holding the full blocks of `tokens`, in order. Stops at the
        first block whose tokens are already cached in another block (that copy stays
        with its holder). Returns how many of `blocks` are cached now."""
        node = self._root(namespace)
        for i, b in enumerate(blocks):
            key = self._key(tokens, i)
            if len(key) < self.block_size:
                return i
            child = node.children.get(key)
            if child is None:
                if self.pool.is_cached(b):
                    return i  # already cached under another prefix: keep the tree a tree
                child = _Node(key, b, node)
                node.children[key] = child
                self._by_block[b] = child
                self.pool.mark_cached(b)
            elif child.block != b:
                return i
            node = child
        return len(blocks)

    def evict(self, n: int) -> int:
        """Free at least n unreferenced cached blocks (LRU first); returns how many."""
        freed = 0
        while freed < n:
            b = self.pool.lru_evictable()
            if b is None:
                break
            freed += self._drop(self._by_block[b])
        return freed

    def trim(self) -> None:
        """Keep the unreferenced part of the cache within its block budget."""
        if self.max_cached_blocks is not None:
            extra = self.pool.num_evictable_blocks - self.max_cached_blocks
            if extra > 0:
                self.evict(extra)

    def _drop(self, node: _Node) -> int:
        count = 0
        for child in list(node.children.values()):
            count += self._drop(child)
        assert node.parent is not None
        del node.parent.children[node.key]
        del self._by_block[node.block]
        self.pool.evict(node.block)
        self.num_evicted += 1
        return count + 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    def cached_blocks(self) -> set[int]:
        return set(self._by_block)

    def check_integrity(self) -> None:
        seen: set[int] = set()
        roots = {id(r) for r in self._roots.values()}
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.key != key or child.parent is not node or len(key) != self.block_size:
                    raise AssertionError("prefix tree links are inconsistent")
                if child.block in seen or self._by_block.get(child.block) is not child:
                    raise AssertionError(f"block {child.block} appears twice in the prefix tree")
                if self.pool.ref_count(child.block) > 0 and id(node) not in roots:
                    if self.pool.ref_count(node.block) == 0:
                        raise AssertionError(f"held block {child.block} under an unheld parent")
                seen.add(child.block)
                stack.append(child)
        if seen != set(self._by_block):
            raise AssertionError("prefix tree index out of date")
