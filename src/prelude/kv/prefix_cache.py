"""Block-level radix tree over full KV blocks: find cached prefixes, publish new ones.

Each edge is one full block of tokens; a node owns the pool block that holds those
tokens' K/V. Holders pin blocks through the pool's ref counts; unreferenced cached
blocks are evictable, least recently released first. Because requests hold whole
chains (a prefix's blocks in order) and release them tail first, the LRU block is a
leaf in practice; evicting an inner node drops its (equally unreferenced) subtree.

Each namespace has a tree of its own: K/V computed under one LoRA adapter are never
found by a request of another adapter or of the base ("" is the base's namespace).

The tree holds no Python object per node that the cyclic collector tracks: nodes are ints
(a cached block, or a namespace's root: -1, -2, ...), a block's tokens are kept as
bytes, and every map is from ints or bytes to ints or bytes. Such dicts are never tracked,
so a full collection (GIL held) never walks the cache. With a node object per block every
full pass walked one object per cached block; with tuples for keys, the maps holding them
were tracked again by every insert and walked item by item.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterator

from prelude.kv.block_pool import BlockPool
from prelude.kv.state_checkpoints import StateCheckpoints

PARTIAL_SCAN = 64  # children compared for a hit ending inside a block (see PrefixCache.partial)
_TOKEN_BYTES = 8  # array("q"), memoryview.cast("q")


def _token_bytes(tokens: list[int]) -> bytes:
    return array("q", tokens).tobytes()


def _node_bytes(node: int) -> bytes:
    return node.to_bytes(8, "little", signed=True)


def _tokens_agreed(a: bytes, b: bytes) -> int:
    """How many leading tokens two token runs (as bytes) share."""
    x, y = memoryview(a).cast("q"), memoryview(b).cast("q")
    n, most = 0, min(len(x), len(y))
    while n < most and x[n] == y[n]:
        n += 1
    return n


@dataclass(frozen=True)
class CheckpointHit:
    """A cached prefix that ends at a state checkpoint: its full blocks, the cached block
    it ends inside (None: it ends at a block boundary), its length and the checkpoint."""

    blocks: list[int]
    copy_from: int | None
    num_tokens: int
    slot: int


def _relink(links: dict[int, int], key: int, target: int | None) -> None:
    if target is None:
        del links[key]
    else:
        links[key] = target


class PrefixCache:
    """`_child[node bytes + tokens]` is the child of `node` holding those tokens; `_parent`
    and `_tokens` map a cached block back. A node's children are a doubly linked list in
    insertion order (`_first`/`_last` child, `_next`/`_prev` sibling): `partial` scans the
    oldest first, `_drop` walks a subtree."""

    def __init__(self, pool: BlockPool, block_size: int, max_cached_blocks: int | None = None,
                 checkpoints: StateCheckpoints | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_cached_blocks = max_cached_blocks
        self._roots: dict[str, int] = {}
        self._child: dict[bytes, int] = {}
        self._parent: dict[int, int] = {}
        self._tokens: dict[int, bytes] = {}
        self._first: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._next: dict[int, int] = {}
        self._prev: dict[int, int] = {}
        self.num_evicted = 0
        pool.set_evictor(self.evict)
        # State checkpoints (models with recurrent layers): the state after the first
        # `offset` tokens of a node's block (1..block_size), keyed node * (block_size + 1)
        # + offset, so the maps stay int -> int; `_ckpt_count`: how many a node holds.
        self.checkpoints = checkpoints
        self._ckpt: dict[int, int] = {}
        self._ckpt_key: dict[int, int] = {}
        self._ckpt_count: dict[int, int] = {}
        if checkpoints is not None:
            checkpoints.set_forget(self._forget_checkpoint)

    def _key(self, tokens: list[int], i: int) -> bytes:
        """Block i's tokens, as bytes."""
        return _token_bytes(tokens[i * self.block_size : (i + 1) * self.block_size])

    def _root(self, namespace: str) -> int:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = -1 - len(self._roots)
        return root

    def _children(self, node: int) -> Iterator[int]:
        child = self._first.get(node)
        while child is not None:
            yield child
            child = self._next.get(child)

    def match(self, tokens: list[int], max_blocks: int, namespace: str = "") -> list[int]:
        """Blocks of the longest cached prefix of `tokens`, at most `max_blocks` of them."""
        node = self._roots.get(namespace)
        if node is None:
            return []
        blocks: list[int] = []
        for i in range(min(max_blocks, len(tokens) // self.block_size)):
            child = self._child.get(_node_bytes(node) + self._key(tokens, i))
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
        want_bytes = _token_bytes(want)
        best, best_len = -1, 0
        for i, block in enumerate(self._children(node)):
            if i == PARTIAL_SCAN or best_len == len(want):
                break
            n = _tokens_agreed(self._tokens[block], want_bytes)
            if n > best_len:
                best, best_len = block, n
        return (best, best_len) if best_len else None

    # --- state checkpoints --------------------------------------------------------------

    def _node_checkpoints(self, node: int, most: int) -> Iterator[tuple[int, int]]:
        """(offset, slot) of the node's checkpoints at offsets <= most, deepest first."""
        if not self._ckpt_count.get(node):
            return
        base = node * (self.block_size + 1)
        for offset in range(min(most, self.block_size), 0, -1):
            slot = self._ckpt.get(base + offset)
            if slot is not None:
                yield offset, slot

    def checkpoint_hit(self, tokens: list[int], limit: int, namespace: str = "",
                       inside_blocks: bool = True) -> tuple[CheckpointHit | None, int]:
        """The longest cached prefix of `tokens`, at most `limit` tokens long, that ends at a
        checkpoint (None: none), and how far the cached K/V agree with `tokens` at all
        (within `limit`: where a row computing them could add one). `inside_blocks`: hits
        may end inside a block (a row that copies that block's first slots); otherwise only
        at block boundaries."""
        node = self._roots.get(namespace)
        if node is None or limit <= 0:
            return None, 0
        bs = self.block_size
        best: CheckpointHit | None = None
        blocks: list[int] = []
        i = 0
        while (i + 1) * bs <= len(tokens) and i * bs < limit:
            child = self._child.get(_node_bytes(node) + self._key(tokens, i))
            if child is None:
                break
            for offset, slot in self._node_checkpoints(child, limit - i * bs if inside_blocks else bs):
                if offset == bs and (i + 1) * bs <= limit:
                    best = CheckpointHit(blocks + [child], None, (i + 1) * bs, slot)
                    break
                if offset < bs and inside_blocks:
                    best = CheckpointHit(list(blocks), child, i * bs + offset, slot)
                    break
            blocks.append(child)
            node = child
            i += 1
        agreed = min(i * bs, limit)
        if agreed < limit and node in self._first:  # the next block's tokens, against cached children
            want = _token_bytes(tokens[i * bs : i * bs + min(limit - i * bs, bs)])
            for n, block in enumerate(self._children(node)):
                if n == PARTIAL_SCAN:
                    break
                k = _tokens_agreed(self._tokens[block], want)
                agreed = max(agreed, i * bs + k)
                if not inside_blocks or (best is not None and best.num_tokens >= i * bs + k):
                    continue
                for offset, slot in self._node_checkpoints(block, k):
                    if offset < bs:
                        best = CheckpointHit(list(blocks), block, i * bs + offset, slot)
                    break
        return best, agreed

    def attach_checkpoint(self, tokens: list[int], position: int, slot: int, namespace: str = "") -> bool:
        """Make `slot` the checkpoint of the state after tokens[:position]: on the node of
        the block holding tokens[position - 1] (a cached block whose first tokens up to it
        are these). False (nothing attached) when no such node is cached, or one already
        has a checkpoint there."""
        node = self._roots.get(namespace)
        if node is None or position <= 0 or self.checkpoints is None:
            return False
        bs = self.block_size
        j, offset = (position - 1) // bs, position - (position - 1) // bs * bs
        for i in range(j):
            node = self._child.get(_node_bytes(node) + self._key(tokens, i))  # type: ignore[assignment]
            if node is None:
                return False
        target = self._child.get(_node_bytes(node) + self._key(tokens, j)) if len(tokens) >= (j + 1) * bs else None
        if target is None and offset < bs:
            want = _token_bytes(tokens[j * bs : position])
            for n, block in enumerate(self._children(node)):
                if n == PARTIAL_SCAN:
                    break
                if self._tokens[block].startswith(want):
                    target = block
                    break
        if target is None:
            return False
        key = target * (bs + 1) + offset
        if key in self._ckpt:
            return False
        self._ckpt[key] = slot
        self._ckpt_key[slot] = key
        self._ckpt_count[target] = self._ckpt_count.get(target, 0) + 1
        self.checkpoints.attach(slot)
        return True

    def _forget_checkpoint(self, slot: int) -> None:
        """Unmap a checkpoint (the pool evicts it for room)."""
        key = self._ckpt_key.pop(slot)
        del self._ckpt[key]
        node = key // (self.block_size + 1)
        left = self._ckpt_count[node] - 1
        if left:
            self._ckpt_count[node] = left
        else:
            del self._ckpt_count[node]

    def _drop_checkpoints(self, node: int) -> None:
        if not self._ckpt_count.get(node) or self.checkpoints is None:
            return
        for _, slot in list(self._node_checkpoints(node, self.block_size)):
            self._forget_checkpoint(slot)
            self.checkpoints.detach(slot)

    def attached_checkpoints(self) -> set[int]:
        return set(self._ckpt_key)

    @property
    def num_checkpoints(self) -> int:
        return len(self._ckpt)

    def insert(self, tokens: list[int], blocks: list[int], namespace: str = "") -> int:
        """Register `blocks` as holding the full blocks of `tokens`, in order. Stops at the
        first block whose tokens are already cached in another block (that copy stays
        with its holder). Returns how many of `blocks` are cached now."""
        node = self._root(namespace)
        for i, b in enumerate(blocks):
            if (i + 1) * self.block_size > len(tokens):
                return i
            key = self._key(tokens, i)
            edge = _node_bytes(node) + key
            child = self._child.get(edge)
            if child is None:
                if self.pool.is_cached(b):
                    return i  # already cached under another prefix: keep the tree a tree
                self._child[edge] = b
                self._parent[b] = node
                self._tokens[b] = key
                last = self._last.get(node)
                if last is None:
                    self._first[node] = b
                else:
                    self._next[last], self._prev[b] = b, last
                self._last[node] = b
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
            subtree.extend(self._children(node))
        for node in reversed(subtree):
            parent = self._parent.pop(node)
            del self._child[_node_bytes(parent) + self._tokens.pop(node)]
            prev, nxt = self._prev.pop(node, None), self._next.pop(node, None)
            # what pointed at node (the sibling before, or the parent's first-child slot) now
            # points past it, and likewise from the other side
            _relink(self._first if prev is None else self._next, parent if prev is None else prev, nxt)
            _relink(self._last if nxt is None else self._prev, parent if nxt is None else nxt, prev)
            self._drop_checkpoints(node)
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
            prev = None
            for child in self._children(node):
                key = self._tokens.get(child)
                if (key is None or self._parent.get(child) != node or self._prev.get(child) != prev
                        or len(key) != self.block_size * _TOKEN_BYTES
                        or self._child.get(_node_bytes(node) + key) != child):
                    raise AssertionError("prefix tree links are inconsistent")
                if child in seen:
                    raise AssertionError(f"block {child} appears twice in the prefix tree")
                if self.pool.ref_count(child) > 0 and node not in roots and self.pool.ref_count(node) == 0:
                    raise AssertionError(f"held block {child} under an unheld parent")
                seen.add(child)
                stack.append(child)
                prev = child
            if self._last.get(node) != prev:
                raise AssertionError("prefix tree links are inconsistent")
        if seen != set(self._parent) or seen != set(self._tokens) or len(self._child) != len(seen):
            raise AssertionError("prefix tree index out of date")
        if not set(self._first) <= roots | seen:
            raise AssertionError("prefix tree keeps children of a dropped node")
        counts: dict[int, int] = {}
        for key, slot in self._ckpt.items():
            node, offset = divmod(key, self.block_size + 1)
            if node not in seen or not 1 <= offset <= self.block_size or self._ckpt_key.get(slot) != key:
                raise AssertionError(f"checkpoint slot {slot} is mapped to no cached node")
            counts[node] = counts.get(node, 0) + 1
        if counts != self._ckpt_count or len(self._ckpt_key) != len(self._ckpt):
            raise AssertionError("checkpoint index out of date")
