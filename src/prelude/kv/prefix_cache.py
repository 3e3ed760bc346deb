"""Block-level radix tree over full KV blocks: find cached prefixes, publish new ones.

Each edge is one full block of tokens; a node owns the pool block that holds those
tokens' K/V. Holders pin blocks through the pool's ref counts; unreferenced cached
blocks are evictable, least recently released first. Because requests hold whole
chains (a prefix's blocks in order) and release them tail first, the LRU block is a
leaf in practice; evicting an inner node drops its (equally unreferenced) subtree.

Each namespace has a tree of its own: K/V computed under one LoRA adapter are never
found by a request of another adapter or of the base ("" is the base's namespace).

The tree is held in dicts of ints and tuples of ints, with no object per node. CPython's
cyclic collector stops tracking such tuples and dicts after their first pass, so its full
passes never walk the cache. With a `_Node` object per block (and its children dict) every
full pass walked two objects per cached block: 28-37 ms a pass, every ~1.3 s, with the GIL
held, for the free model's pool under `bench overhead` on the 2-core Zen 5.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from prelude.kv.block_pool import BlockPool

PARTIAL_SCAN = 64  # children compared for a hit ending inside a block (see PrefixCache.partial)
_NO_CHILDREN: Mapping[tuple[int, ...], int] = MappingProxyType({})


class PrefixCache:
    """Nodes are ints: a cached block's id, or a namespace's root (-1, -2, ...; never a
    pool block). `_children[node]` maps each child's tokens to its block (insertion order:
    `partial` scans the oldest first); `_parent` and `_tokens` map a cached block back."""

    def __init__(self, pool: BlockPool, block_size: int, max_cached_blocks: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_cached_blocks = max_cached_blocks
        self._roots: dict[str, int] = {}
        self._children: dict[int, dict[tuple[int, ...], int]] = {}
        self._parent: dict[int, int] = {}
        self._tokens: dict[int, tuple[int, ...]] = {}
        self.num_evicted = 0
        pool.set_evictor(self.evict)

    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def _root(self, namespace: str) -> int:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = -1 - len(self._roots)
        return root

    def _kids(self, node: int) -> Mapping[tuple[int, ...], int]:
        return self._children.get(node, _NO_CHILDREN)

    def match(self, tokens: list[int], max_blocks: int, namespace: str = "") -> list[int]:
        """Blocks of the longest cached prefix of `tokens`, at most `max_blocks` of them."""
        node = self._roots.get(namespace)
        if node is None:
            return []
        blocks: list[int] = []
        for i in range(min(max_blocks, len(tokens) // self.block_size)):
            child = self._kids(node).get(self._key(tokens, i))
            if child is None:
                break
            blocks.append(child)
            node = child
        return blocks

    def partial(self, tokens: list[int], matched: list[int], limit: int, namespace: str = "") -> tuple[int, int] | None:
        """After the full blocks `matched` (what `match` returned for `tokens`): the cached
        block whose leading tokens agree longest with `tokens`' next block, up to `limit`
        tokens; (block, tokens agreed) or None. K/V of a token depend only on the tokens
        before it, so those slots of that block are this prompt's too. A node may have
        thousands of children (one per judged item after a rubric): the first
        PARTIAL_SCAN are compared, which share whatever the items' template shares."""
        if matched:
            node: int | None = matched[-1] if matched[-1] in self._parent else None
        else:
            node = self._roots.get(namespace)
        if node is None or limit <= 0:
            return None
        start = len(matched) * self.block_size
        want = tokens[start : start + min(limit, self.block_size - 1)]
        best, best_len = -1, 0
        for i, (key, block) in enumerate(self._kids(node).items()):
            if i == PARTIAL_SCAN or best_len == len(want):
                break
            n = 0
            while n < len(want) and key[n] == want[n]:
                n += 1
            if n > best_len:
                best, best_len = block, n
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
            child = self._kids(node).get(key)
            if child is None:
                if self.pool.is_cached(b):
                    return i  # already cached under another prefix: keep the tree a tree
                self._children.setdefault(node, {})[key] = b
                self._parent[b] = node
                self._tokens[b] = key
                self.pool.mark_cached(b)
            elif child != b:
                return i
            node = b
        return len(blocks)

    def evict(self, n: int) -> int:
        """Free at least n unreferenced cached blocks (LRU first); returns how many."""
        freed = 0
        while freed < n:
            b = self.pool.lru_evictable()
            if b is None:
                break
            freed += self._drop(b)
        return freed

    def trim(self) -> None:
        """Keep the unreferenced part of the cache within its block budget."""
        if self.max_cached_blocks is not None:
            extra = self.pool.num_evictable_blocks - self.max_cached_blocks
            if extra > 0:
                self.evict(extra)

    def _drop(self, block: int) -> int:
        """Drop a cached block and its subtree, children before parents; how many."""
        if block not in self._parent:
            raise KeyError(f"block {block} is not in the prefix tree")
        subtree = [block]
        for node in subtree:  # grows while it is walked: breadth first
            subtree.extend(self._kids(node).values())
        for node in reversed(subtree):
            self._children.pop(node, None)
            parent = self._parent.pop(node)
            siblings = self._children[parent]
            del siblings[self._tokens.pop(node)]
            if not siblings:
                del self._children[parent]
            self.pool.evict(node)
            self.num_evicted += 1
        return len(subtree)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._parent)

    def cached_blocks(self) -> set[int]:
        return set(self._parent)

    def check_integrity(self) -> None:
        seen: set[int] = set()
        roots = set(self._roots.values())
        stack = list(roots)
        while stack:
            node = stack.pop()
            for key, child in self._kids(node).items():
                if self._tokens.get(child) != key or self._parent.get(child) != node or len(key) != self.block_size:
                    raise AssertionError("prefix tree links are inconsistent")
                if child in seen:
                    raise AssertionError(f"block {child} appears twice in the prefix tree")
                if self.pool.ref_count(child) > 0 and node not in roots and self.pool.ref_count(node) == 0:
                    raise AssertionError(f"held block {child} under an unheld parent")
                seen.add(child)
                stack.append(child)
        if seen != set(self._parent) or seen != set(self._tokens):
            raise AssertionError("prefix tree index out of date")
        if any(not kids or (node not in roots and node not in seen) for node, kids in self._children.items()):
            raise AssertionError("prefix tree keeps children of a dropped node, or an empty children map")
