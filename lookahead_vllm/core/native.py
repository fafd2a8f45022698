"""Native drafting core: loads ``lookahead_vllm._draft_index`` (C++,
``csrc/draft_index``, compiled by ``pip install -e .``) and picks it or the
pure-Python reference ``DraftIndex``; both give identical drafts. The same
extension holds the planner's kernels (core/tree_plan.py).

Never compiles anything: a missing extension means the reference is used
(or, when the native core is required, an ImportError that says how to build it).
"""

from __future__ import annotations

import functools
import logging

from lookahead_vllm.core.draft_index import DraftIndex, DraftIndexConfig

logger = logging.getLogger(__name__)

BUILD_HINT = ("build it with `pip install -e .` (or `python setup.py build_ext --inplace`) "
              "from the repository root; it needs a C++17 compiler and pybind11")


@functools.cache
def load_extension():
    """The extension module (``DraftIndex`` and the planner's kernels
    ``plan_trees``, ``match_trees``, ``observe_trees``), or None if it is
    not built."""
    try:
        from lookahead_vllm import _draft_index
    except ImportError as exc:
        logger.debug("native extension unavailable: %s", exc)
        return None
    return _draft_index


def load_draft_index() -> type | None:
    """The native ``DraftIndex`` class, or None if the extension is not built."""
    module = load_extension()
    return None if module is None else module.DraftIndex


@functools.cache
def _log_choice(native: bool) -> None:
    if native:
        logger.info("draft index: native (lookahead_vllm._draft_index)")
    else:
        logger.info("draft index: pure-Python reference (native extension not built; %s)", BUILD_HINT)


def make_draft_index(config: DraftIndexConfig, native: bool | None = None,
                     upkeep_thread: bool = False):
    """A draft index for ``config``: native when available (``native=None``),
    required (``True``: ImportError if not built) or the reference (``False``).
    Either object has ``.config``, ``.native`` and ``.upkeep_thread``:
    whether the native index runs its upkeep (core/draft_index.py) on a
    thread of its own (the results are the same; the reference never does)."""
    cls = load_draft_index() if native is not False else None
    if cls is None:
        if native:
            raise ImportError(f"lookahead_vllm._draft_index is not built: {BUILD_HINT}")
        _log_choice(False)
        return DraftIndex(config)
    index = cls(config.ngram, config.max_match, config.max_occurrences, config.max_candidates,
                config.corpus_bytes, upkeep_thread=upkeep_thread)
    index.config = config
    _log_choice(True)
    return index
