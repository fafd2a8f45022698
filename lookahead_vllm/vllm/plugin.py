"""``vllm.general_plugins`` entry point, called by vLLM in every process before it builds configs or registers kernels.
Without lookahead selected the patches are inert but for two CPU fixes and the ``lookahead*`` ``extra_args`` check."""

from __future__ import annotations

import functools

from vllm.logger import init_logger

logger = init_logger(__name__)


@functools.cache  # once per process (a call that raised runs again)
def register() -> None:
    """Apply the plugin's patches (a failing one is logged, never raised); the proposer gets the worker-side ones."""
    from lookahead_vllm.vllm import guards, logs, metrics, patches
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    problem = guards.stack_problem()
    if problem is not None:
        logger.warning("lookahead-vllm: %s; lookahead will be refused unless %s=1", problem, guards.SKIP_VERSION_ENV)

    logs.share_vllm_handlers()
    for name in patches.EAGER:  # cheap: config classes only
        patches.apply(name)
    LookaheadProposer.prepare_engine = staticmethod(patches.prepare_engine)
    metrics.setup_process()
