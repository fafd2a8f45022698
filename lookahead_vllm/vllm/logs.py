"""Route this package's log records through vLLM's logging setup.

vLLM configures only the ``vllm`` logger; records of ``lookahead_vllm.*`` loggers would reach Python's last-resort
handler, which drops INFO. vLLM configures it after the plugins load (``LLM.__init__``, the CLI after parsing its
arguments), and a forked worker keeps whatever its parent had then; so the records are handed to the ``vllm`` logger
when they are logged, not its handlers copied when the plugin loads.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "lookahead_vllm"


class _ThroughVllm(logging.Handler):
    """Log a record as if it came from a child of the ``vllm`` logger: its level, its
    handlers, and its propagation (to the root where vLLM's configuration is off)."""

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
