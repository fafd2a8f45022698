"""Load adaptation: the per-request draft budget as a function of batch size.

A draft token is nearly free while the forward pass is memory-bound; with
many requests running, every draft token costs real compute and a busy
server must never get slower because of lookahead. So the per-request node
budget stays at ``decoding_length`` up to ``load_shrink_above`` running
requests, shrinks linearly above it and reaches zero (no drafting) at
``load_stop_at``.

Example: decoding_length 8, shrink above 8, stop at 16 (the defaults):
running 8 -> 8, 12 -> 4, 15 -> 1, 16 -> 0.
"""

from __future__ import annotations

from lookahead_vllm.core.config import LookaheadConfig


def load_scaled_budget(config: LookaheadConfig, num_running: int) -> int:
    """Draft nodes per request when ``num_running`` requests share the step."""
    full = config.decoding_length
    if num_running <= config.load_shrink_above:
        return full
    if num_running >= config.load_stop_at:
        return 0
    span = config.load_stop_at - config.load_shrink_above
    left = config.load_stop_at - num_running
    return -(-full * left // span)  # ceil
