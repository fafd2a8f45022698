"""``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process (API server, engine core, each
worker) before it builds configs or registers kernels. It must be cheap and
re-entrant: it only applies the named patches in :mod:`.patches`, each once.
With the plugin installed but lookahead not requested, every patch is inert:
they only act when ``speculative_config.method == "lookahead"`` or, for the
CPU sampling fix, replace a broken kernel override with a correct one.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.32.",)
_registered = False


def register() -> None:
    """Apply the plugin's patches (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        logger.warning(
            "lookahead-vllm was tested with vLLM %s; found %s", "/".join(SUPPORTED_VLLM), version
        )
    from lookahead_vllm.vllm import patches

    patches.apply_all()
