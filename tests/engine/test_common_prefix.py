"""scheduler.common_prefix (the burst gathering's "a peer counts past the prefix it shares
with the one before it") against a token-by-token reference, across its 64-token chunks."""

import random

from prelude.engine.scheduler import common_prefix


def _reference(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_common_prefix_matches_a_token_by_token_scan() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        base = [rng.randrange(3) for _ in range(rng.randrange(0, 300))]
        a = base + [rng.randrange(3) for _ in range(rng.randrange(0, 200))]
        b = base[: rng.randrange(0, len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 200))]
        assert common_prefix(a, b) == common_prefix(b, a) == _reference(a, b)


def test_common_prefix_at_chunk_edges_and_of_equal_or_empty_prompts() -> None:
    p = list(range(200))
    for cut in (0, 1, 63, 64, 65, 127, 128, 199):
        assert common_prefix(p, p[:cut] + [-1] + p[cut + 1:]) == cut
    assert common_prefix(p, p) == 200
    assert common_prefix(p, p[:128]) == 128
    assert common_prefix([], p) == 0
