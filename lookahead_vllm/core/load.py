"""Load adaptation: the per-request draft budget as a function of batch size.

A draft token is nearly free while the forward pass is memory-bound; with many requests running,
every draft token costs real compute and a busy server must never get slower because of lookahead.
So the per-request node budget stays at ``decoding_length`` up to ``load_shrink_above`` running
requests, shrinks linearly above it and reaches zero (no drafting) at ``load_stop_at``. The
forward-cost model (core/budget.py) then prices every node that is left against the step's load.

Example: decoding_length 8, shrink above 8, stop at 16 (the CPU's defaults): running
8 -> 8, 12 -> 4, 15 -> 1, 16 -> 0.
"""

from __future__ import annotations

from lookahead_vllm.core.config import Settings


def load_scaled_budget(config: Settings, num_running: int) -> int:
    """Draft nodes per request when ``num_running`` requests share the step (the limits: the
    profile's ``load_shrink_above`` and ``load_stop_at``, core/config.py)."""
    full = config.decoding_length
    shrink_above, stop_at = config.profile.load_shrink_above, config.profile.load_stop_at
    if num_running <= shrink_above:
        return full
    if num_running >= stop_at:
        return 0
    span = stop_at - shrink_above
    left = stop_at - num_running
    return -(-full * left // span)  # ceil
