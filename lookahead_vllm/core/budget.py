"""Sharing one step's draft budget across the batch.

A forward over ``T`` tokens costs about the same as one token only up to a
machine-dependent *critical decoding length*; beyond it every draft token
costs real time. With many requests in the batch, the step budget goes to the
draft tokens most likely to be accepted: each request offers its chain with
the path confidence of every position (non-increasing along the chain), and
the ``budget`` most confident positions across the batch are kept, each
request keeping a prefix of its chain.

Example: confidences ``[[0.9, 0.5, 0.2], [0.8, 0.7]]`` with budget 3 keep
``[0.9]`` + ``[0.8, 0.7]`` -> prefix lengths ``[1, 2]``.
"""

from __future__ import annotations

from typing import Sequence


def allocate_step_budget(confidences: Sequence[Sequence[float]], budget: int) -> list[int]:
    """Prefix length to keep per request so that at most ``budget`` tokens are drafted."""
    wanted = [len(c) for c in confidences]
    if sum(wanted) <= budget:
        return wanted
    ranked = sorted(
        (-conf, pos, req) for req, confs in enumerate(confidences) for pos, conf in enumerate(confs)
    )
    keep = [0] * len(confidences)
    taken = 0
    for _, pos, req in ranked:
        if taken == budget:
            break
        if pos == keep[req]:  # only extend a prefix
            keep[req] += 1
            taken += 1
    return keep
