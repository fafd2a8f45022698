"""``vllm.general_plugins`` entry point, called by vLLM in every process (API server, engine core, each worker)
before it builds configs or registers kernels. Without lookahead selected the patches are inert, except the two CPU
fixes (``cpu_expand_kernel``, ``cpu_kernel_overrides_once``) that change plain vLLM on purpose; greedy plain output
is unchanged (tested with the plugin filtered out).
"""

from __future__ import annotations

import functools

from vllm.logger import init_logger

logger = init_logger(__name__)


@functools.cache  # once per process (a call that raised runs again)
def register() -> None:
    """Apply the plugin's patches (cheap, re-entrant: a failing one is logged, never raised) and hand the
    proposer the worker-side ones (:func:`.patches.prepare_engine`)."""
    from lookahead_vllm.vllm import guards, logs, metrics, patches
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    problem = guards.stack_problem()
    if problem is not None:
        logger.warning("lookahead-vllm: %s; lookahead will be refused unless %s=1", problem, guards.SKIP_VERSION_ENV)

    logs.share_vllm_handlers()
    for name in patches.EAGER:  # cheap: config classes only
        patches.apply(name)
    LookaheadProposer.prepare_engine = staticmethod(patches.prepare_engine)
    metrics.setup_process()  # lookahead_* series on /metrics (see metrics.py)
