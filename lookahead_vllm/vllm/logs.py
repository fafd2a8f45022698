"""Route this package's log records through vLLM's logging setup.

vLLM configures only the ``vllm`` logger; records of ``lookahead_vllm.*``
loggers would reach Python's last-resort handler, which drops INFO.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "lookahead_vllm"


def share_vllm_handlers() -> None:
    """Give the ``lookahead_vllm`` logger vLLM's handlers and level (idempotent)."""
    ours, theirs = logging.getLogger(PACKAGE_LOGGER), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False
