"""Which replica gets a request: round robin, least load, or prefix affinity.

The prefix router keeps, per replica, an approximate radix tree of the prompts sent
there: a tree over fixed-size token blocks, stored as chained block hashes (a block's
key folds in its parent's key, so one dict lookup per block walks the tree). It is
approximate on purpose: it never hears about the replica's own evictions, and it
forgets its least recently used blocks past a capacity, which stands in for them.
Requests under a LoRA adapter keep affinity to one replica (where its slot is likely
resident and its prefixes cached): its last replica, unless that one is out of balance
or not a candidate; prefix trees are kept per adapter (K/V never match across adapters).
The rule follows SGLang's cache-aware router: when load is out of balance (the
busiest replica has more than `balance_abs_threshold` requests more than the idlest
AND more than `balance_rel_threshold` times as many) go to the idlest; otherwise go to
the longest match if it covers at least `cache_threshold` of the prompt, else to the
least loaded replica (ties: the one with the smallest tree, i.e. the most room).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

ROUTERS = ("round_robin", "least_load", "prefix")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "round_robin"
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3
    block_size: int = 16  # tree granularity in tokens
    tree_max_blocks: int = 1 << 16  # per replica: the approximate capacity of its cache

    def __post_init__(self) -> None:
        if self.policy not in ROUTERS:
            raise ValueError(f"unknown router {self.policy!r}; use one of {', '.join(ROUTERS)}")
        if self.block_size < 1 or self.tree_max_blocks < 1:
            raise ValueError("router block size and tree capacity must be positive")


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: str  # round_robin | least_load | prefix_match | balance | no_match
    matched_tokens: int = 0


class ApproxPrefixTree:
    """Block-granular prefix tree with LRU forgetting (see the module docstring)."""

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _keys(self, tokens: Sequence[int], adapter: str | None = None) -> list[int]:
        keys, parent, bs = [], 0 if adapter is None else hash(adapter), self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = hash((parent, tuple(tokens[start:start + bs])))
            keys.append(parent)
        return keys

    def match(self, tokens: Sequence[int], adapter: str | None = None) -> int:
        """Tokens of the longest cached prefix (whole blocks) under `adapter`."""
        n = 0
        for key in self._keys(tokens, adapter):
            if key not in self._blocks:
                break
            n += 1
        return n * self.block_size

    def insert(self, tokens: Sequence[int], adapter: str | None = None) -> None:
        for key in self._keys(tokens, adapter):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)


@dataclass
class RouterStats:
    decisions: Counter = field(default_factory=Counter)  # (replica, reason) -> count
    prompt_tokens: Counter = field(default_factory=Counter)  # replica -> tokens routed there
    matched_tokens: Counter = field(default_factory=Counter)  # replica -> tokens its tree already held


class Router:
    """Stateful router over replicas 0..n-1. `route` picks among `candidates` (the live,
    eligible replicas) given each replica's load (requests in flight)."""

    def __init__(self, config: RouterConfig, num_replicas: int) -> None:
        self.config = config
        self.num_replicas = num_replicas
        self.stats = RouterStats()
        self._next = 0
        self._trees = [ApproxPrefixTree(config.block_size, config.tree_max_blocks) for _ in range(num_replicas)]
        self._adapter_home: OrderedDict[str, int] = OrderedDict()  # LoRA adapter -> its replica, LRU bounded

    def route(self, prompt: Sequence[int], loads: Sequence[float], candidates: Sequence[int] | None = None,
              adapter: str | None = None) -> Decision:
        cands = list(range(self.num_replicas)) if candidates is None else list(candidates)
        if not cands:
            raise RuntimeError("no replica is available")
        policy = self.config.policy
        home = self._adapter_home.get(adapter) if adapter is not None else None
        if home is not None and home in cands and not self._out_of_balance(home, loads, cands):
            decision = Decision(home, "adapter_affinity")
        elif policy == "round_robin":
            decision = self._round_robin(cands)
        elif policy == "least_load":
            decision = Decision(self._least_loaded(cands, loads), "least_load")
        else:
            decision = self._prefix(prompt, loads, cands, adapter)
        self._record(decision, prompt, adapter)
        if adapter is not None:
            self._adapter_home[adapter] = decision.replica
            self._adapter_home.move_to_end(adapter)
            while len(self._adapter_home) > 4096:
                self._adapter_home.popitem(last=False)
        return decision

    def _out_of_balance(self, replica: int, loads: Sequence[float], cands: list[int]) -> bool:
        """`replica` is busier than the idlest candidate by the balance thresholds."""
        lo, load = min(loads[r] for r in cands), loads[replica]
        return load - lo > self.config.balance_abs_threshold and load > self.config.balance_rel_threshold * lo

    def _round_robin(self, cands: list[int]) -> Decision:
        # The next candidate at or after the cursor, so a dead replica's turn passes on.
        pick = min(cands, key=lambda r: (r - self._next) % self.num_replicas)
        self._next = (pick + 1) % self.num_replicas
        return Decision(pick, "round_robin")

    def _least_loaded(self, cands: list[int], loads: Sequence[float]) -> int:
        # Ties go round robin, so an idle cluster still spreads.
        pick = min(cands, key=lambda r: (loads[r], (r - self._next) % self.num_replicas, len(self._trees[r])))
        self._next = (pick + 1) % self.num_replicas
        return pick

    def _prefix(self, prompt: Sequence[int], loads: Sequence[float], cands: list[int],
                adapter: str | None = None) -> Decision:
        cfg = self.config
        lo, hi = min(loads[r] for r in cands), max(loads[r] for r in cands)
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            return Decision(self._least_loaded(cands, loads), "balance")
        matches = {r: self._trees[r].match(prompt, adapter) for r in cands}
        best = max(cands, key=lambda r: (matches[r], -loads[r]))
        if matches[best] > 0 and matches[best] >= cfg.cache_threshold * len(prompt):
            return Decision(best, "prefix_match", matches[best])
        return Decision(self._least_loaded(cands, loads), "no_match")

    def _record(self, decision: Decision, prompt: Sequence[int], adapter: str | None = None) -> None:
        r = decision.replica
        matched = (self._trees[r].match(prompt, adapter) if decision.reason != "prefix_match"
                   else decision.matched_tokens)
        self.stats.decisions[(r, decision.reason)] += 1
        self.stats.prompt_tokens[r] += len(prompt)
        self.stats.matched_tokens[r] += matched
        self._trees[r].insert(prompt, adapter)

    def forget(self, replica: int) -> None:
        """The replica restarted: whatever it cached is gone."""
        self._trees[replica].clear()

    def estimated_hit_rate(self, replica: int) -> float:
        total = self.stats.prompt_tokens[replica]
        return self.stats.matched_tokens[replica] / total if total else 0.0

    def metrics(self) -> dict[str, float]:
        """Decision counters and per-replica estimated hit rates, Prometheus-labelled names."""
        out: dict[str, float] = {}
        for (r, reason), n in sorted(self.stats.decisions.items()):
            out[f'router_decisions_total{{replica="{r}",reason="{reason}"}}'] = n
        for r in range(self.num_replicas):
            out[f'router_estimated_prefix_hit_rate{{replica="{r}"}}'] = self.estimated_hit_rate(r)
            out[f'router_tree_blocks{{replica="{r}"}}'] = len(self._trees[r])
        return out
