"""Load adaptation: the per-request draft budget as a function of batch size.

A draft token is nearly free while the forward pass is memory-bound; with
many requests running, every draft token costs real compute and a busy
server must never get slower because of lookahead. So the per-request node
budget stays at ``decoding_length`` up to ``load_shrink_above`` running
requests, shrinks linearly above it and reaches zero (no drafting) at
``load_stop_at``. The forward-cost model (core/budget.py) then prices every
node that is left against the step's load.

Example: decoding_length 8, shrink above 8, stop at 16 (the CPU's defaults):
running 8 -> 8, 12 -> 4, 15 -> 1, 16 -> 0.
"""

from __future__ import annotations

from lookahead_vllm.core.config import LookaheadConfig

# (load_shrink_above, load_stop_at) where the config leaves them at -1.
# "cpu": this project's 2-core CPU, where a batch of 8 already scores past
# the ~5 tokens a forward takes for the price of one. "gpu": a GPU scores
# ~64 tokens for the price of one (budget.PLATFORM_TOKEN_COSTS), so drafting
# pays up to ~64 running requests and the cost model, not a blanket stop,
# decides what is kept; the budget shrinks from 32 requests on and stops at
# 128 (the cost model keeps no draft from 64 rows on at its GPU prices).
PLATFORM_LOAD_LIMITS: dict[str, tuple[int, int]] = {"cpu": (8, 16), "gpu": (32, 128)}


def load_limits(config: LookaheadConfig, platform: str) -> tuple[int, int]:
    """``(load_shrink_above, load_stop_at)`` of ``config`` on ``platform``
    ("cpu" or "gpu"): -1 takes :data:`PLATFORM_LOAD_LIMITS`, moved where
    needed to stay on the right side of the one value given."""
    shrink, stop = PLATFORM_LOAD_LIMITS[platform]
    if config.load_shrink_above >= 0:
        shrink = config.load_shrink_above
        stop = config.load_stop_at if config.load_stop_at >= 0 else max(stop, shrink + 1)
    elif config.load_stop_at >= 0:
        stop = config.load_stop_at
        shrink = min(shrink, stop - 1)
    return shrink, stop


def load_scaled_budget(config: LookaheadConfig, num_running: int, platform: str = "cpu") -> int:
    """Draft nodes per request when ``num_running`` requests share the step on ``platform``."""
    full = config.decoding_length
    shrink_above, stop_at = load_limits(config, platform)
    if num_running <= shrink_above:
        return full
    if num_running >= stop_at:
        return 0
    span = stop_at - shrink_above
    left = stop_at - num_running
    return -(-full * left // span)  # ceil
