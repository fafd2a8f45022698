"""Load adaptation: the per-request draft budget as a function of batch size. Draft tokens are nearly free while the
forward is memory-bound, not with many requests running, and lookahead must never make a busy server slower: the
budget stays at ``decoding_length`` up to ``load_shrink_above`` running requests, shrinks linearly above it and
reaches zero at ``load_stop_at``; the forward-cost model (core/budget.py) prices what is left. Example:
decoding_length 16, shrink above 16, stop at 64 (the CPU's): running 16 -> 16, 32 -> 11, 48 -> 6, 63 -> 1, 64 -> 0.
"""

from __future__ import annotations

from lookahead_vllm.core.config import Settings


def load_scaled_budget(config: Settings, num_running: int) -> int:
    """Draft nodes per request when ``num_running`` requests share the step."""
    shrink_above, stop_at = config.profile.load_shrink_above, config.profile.load_stop_at
    if num_running <= shrink_above:
        return config.decoding_length
    if num_running >= stop_at:
        return 0
    return -(-config.decoding_length * (stop_at - num_running) // (stop_at - shrink_above))  # ceil
