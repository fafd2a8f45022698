"""The package's log records go through vLLM's logging, however late vLLM configures it."""

from __future__ import annotations

import logging

import pytest

from lookahead_vllm.vllm import logs


@pytest.fixture
def loggers():
    """The ``lookahead_vllm`` and ``vllm`` loggers with no handlers (as before vLLM configures
    its logging), restored afterwards."""
    ours, theirs = logging.getLogger(logs.PACKAGE_LOGGER), logging.getLogger("vllm")
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in (ours, theirs)]
    for lg in (ours, theirs):
        lg.handlers.clear()
    yield ours, theirs
    for lg, handlers, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_records_reach_handlers_vllm_configures_after_the_plugin_loaded(loggers):
    ours, theirs = loggers
    logs.share_vllm_handlers()  # the plugin loads first: vLLM has no handlers yet
    logs.share_vllm_handlers()  # idempotent
    assert len(ours.handlers) == 1
    kept = _Keep()
    theirs.addHandler(kept)  # then vLLM configures its logging (LLM.__init__, the CLI)
    theirs.setLevel(logging.INFO)
    logging.getLogger("lookahead_vllm.vllm.proposer").info("proposer ready %d", 1)
    logging.getLogger("lookahead_vllm.vllm.proposer").debug("hidden")
    assert kept.messages == ["proposer ready 1"]
    theirs.setLevel(logging.DEBUG)  # vLLM's level decides when the record is logged
    logging.getLogger("lookahead_vllm.core").debug("shown")
    assert kept.messages[-1] == "shown"
