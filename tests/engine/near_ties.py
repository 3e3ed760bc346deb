"""Greedy outputs of two runs that may round differently (bf16 under another GEMM shape:
a CUDA-graph bucket pads the batch, so cuBLAS may pick another kernel). They must agree
token for token up to the first difference, and there only on a near-tie: the second run's
token is among the first run's top alternatives, within `tol` of the first run's pick. After
it the texts may part. (A random-weight model's next-token distribution is nearly flat:
three tokens can round to one bf16 logit.)"""

from __future__ import annotations

from collections.abc import Sequence

from prelude.params import TokenLogprob


def first_difference(want: Sequence[TokenLogprob], got: Sequence[TokenLogprob], tol: float) -> int | None:
    """Index of the first differing token (None: equal), asserting it is a near-tie."""
    assert len(want) == len(got), (len(want), len(got))
    for i, (w, g) in enumerate(zip(want, got)):
        if w.token_id == g.token_id:
            continue
        top = dict(w.top)
        assert w.token_id in top and g.token_id in top, (i, w, g)
        assert abs(top[w.token_id] - top[g.token_id]) < tol, (i, w, g)
        return i
    return None
