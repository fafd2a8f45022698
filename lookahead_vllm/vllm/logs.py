"""Route this package's log records through vLLM's logging setup. vLLM configures only the ``vllm`` logger, and only
after the plugins load: each record is handed to it when logged, rather than its handlers copied at plugin load."""

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
