"""Route this package's log records through vLLM's logging setup.

vLLM configures only the ``vllm`` logger (else Python's last-resort handler drops our INFO), and only after the plugins
load (``LLM.__init__``, the CLI after parsing its arguments), a forked worker keeping what its parent had then: so each
record is handed to the ``vllm`` logger when it is logged, rather than its handlers copied when the plugin loads.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "lookahead_vllm"


class _ThroughVllm(logging.Handler):
    """Log a record as a child of the ``vllm`` logger would: its level, handlers and propagation."""

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger("vllm")
        if record.levelno >= theirs.getEffectiveLevel():
            theirs.handle(record)


def share_vllm_handlers() -> None:
    """Hand the ``lookahead_vllm`` logger's records to the ``vllm`` logger (idempotent)."""
    ours = logging.getLogger(PACKAGE_LOGGER)
    if any(isinstance(h, _ThroughVllm) for h in ours.handlers):
        return
    ours.addHandler(_ThroughVllm())
    if ours.level == logging.NOTSET:  # the vllm logger's level decides, when the record is logged
        ours.setLevel(logging.DEBUG)  # (a level set here by the user still filters first)
    ours.propagate = False
