"""The router, the LAPS pool controller and the decode placer, without Ray."""

from __future__ import annotations

import pytest

from prelude.cluster.pools import DecodePlacer, PoolConfig, PoolController
from prelude.cluster.router import ApproxPrefixTree, Router, RouterConfig


def test_tree_matches_whole_blocks_and_forgets_lru() -> None:
    t = ApproxPrefixTree(block_size=4, max_blocks=3)
    t.insert(list(range(10)))  # blocks [0..3], [4..7]; the partial tail is not kept
    assert t.match(list(range(12))) == 8 and t.match([0, 1, 2, 9]) == 0
    t.insert([50, 51, 52, 53, 54, 55, 56, 57])  # two more blocks: the oldest goes
    assert len(t) == 3 and t.match(list(range(8))) == 0


def test_round_robin_skips_unavailable_replicas() -> None:
    r = Router(RouterConfig("round_robin"), 3)
    picks = [r.route([1], [0, 0, 0], [0, 2]).replica for _ in range(4)]
    assert picks == [0, 2, 0, 2]


def test_least_load_picks_idlest_and_spreads_ties() -> None:
    r = Router(RouterConfig("least_load"), 3)
    assert r.route([1], [3, 1, 2]).replica == 1
    assert {r.route([1], [0, 0, 0]).replica for _ in range(3)} == {0, 1, 2}


def test_prefix_router_follows_match_until_imbalanced() -> None:
    r = Router(RouterConfig("prefix", block_size=4, balance_abs_threshold=2, balance_rel_threshold=1.5), 2)
    a, b = list(range(100, 120)), list(range(200, 220))
    first_a = r.route(a + [1], [0, 0]).replica
    first_b = r.route(b + [1], [1, 0] if first_a == 0 else [0, 1]).replica
    assert first_a != first_b
    d = r.route(a + [2], [1, 1])
    assert (d.replica, d.reason, d.matched_tokens) == (first_a, "prefix_match", 20)
    loads = [0, 0]
    loads[first_a] = 5
    d = r.route(a + [3], loads)
    assert d.replica != first_a and d.reason == "balance"
    m = r.metrics()
    assert m[f'router_decisions_total{{replica="{first_a}",reason="prefix_match"}}'] == 1
    assert 0 < r.estimated_hit_rate(first_a) < 1


def test_router_config_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError):
        RouterConfig("random")


def test_pool_controller_moves_toward_pressure_with_reason() -> None:
    c = PoolController(PoolConfig(boundary=100, ratio_threshold=2.0, min_pressure=0.1, cooldown_s=1.0), [0, 1], [2, 3])
    assert c.pool_of(99) == "short" and c.pool_of(100) == "long"
    assert c.rebalance(0.0, [0.0, 0.0, 0.0, 0.0]) is None  # calm: no move
    move = c.rebalance(1.0, [0.0, 0.1, 2.0, 2.0])  # long pool under pressure
    assert move is not None and (move.instance, move.src, move.dst) == (0, "short", "long")
    assert "long pool pressure" in move.reason and c.pools == {"short": [1], "long": [2, 3, 0]}
    assert c.rebalance(1.5, [0.0, 0.0, 9.0, 9.0]) is None  # cooldown
    assert c.rebalance(3.0, [0.0, 0.0, 9.0, 9.0]) is None  # the short pool keeps one instance


def test_decode_placer_backpressure() -> None:
    p = DecodePlacer(max_requests_in_scheduler=2, held=[0, 0])
    assert [p.place() for _ in range(4)] == [0, 1, 0, 1]
    assert p.place() is None and p.waits == 1
    p.release(1)
    assert p.place() == 1


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "prefix"])
def test_adapter_requests_keep_affinity_unless_out_of_balance(policy: str) -> None:
    r = Router(RouterConfig(policy, balance_abs_threshold=2, balance_rel_threshold=1.5), 3)
    first = {name: r.route([7, 8, 9, 10], [0, 0, 0], adapter=name).replica for name in ("judge", "chat")}
    for _ in range(4):  # the same adapter goes home, whatever the policy's own choice would be
        for name, home in first.items():
            d = r.route([1, 2, 3, 4], [0, 0, 0], adapter=name)
            assert (d.replica, d.reason) == (home, "adapter_affinity")
    loads = [0.0, 0.0, 0.0]
    loads[first["judge"]] = 10  # home out of balance: the request goes elsewhere, and that becomes home
    moved = r.route([1, 2, 3, 4], loads, adapter="judge")
    assert moved.replica != first["judge"]
    assert r.route([5], [0, 0, 0], adapter="judge").replica == moved.replica
    assert r.route([5], [0, 0, 0], [x for x in range(3) if x != moved.replica], adapter="judge").replica != moved.replica


def test_prefix_trees_do_not_match_across_adapters() -> None:
    t = ApproxPrefixTree(block_size=4, max_blocks=100)
    t.insert(list(range(8)), adapter="judge")
    assert t.match(list(range(8)), adapter="judge") == 8
    assert t.match(list(range(8))) == 0 and t.match(list(range(8)), adapter="chat") == 0
