"""The native drafting core ``lookahead_vllm._draft_index`` (``csrc/draft_index``, compiled by ``pip install -e .``),
reached through :func:`extension` so tests can swap in ``lookahead_lab.reference``. Never compiles anything.
"""

from __future__ import annotations

import functools

from lookahead_vllm.core.draft_index import DraftIndexConfig

BUILD_HINT = ("build it with `pip install -e .` (or `python setup.py build_ext --inplace`) "
              "from the repository root; it needs a C++17 compiler and pybind11")


@functools.cache
def extension():
    """The extension module (ImportError with :data:`BUILD_HINT` if it is not built)."""
    try:
        from lookahead_vllm import _draft_index
    except ImportError as exc:
        raise ImportError(f"lookahead_vllm._draft_index is not built: {BUILD_HINT}") from exc
    return _draft_index


def load_extension():
    """The extension module, or None where it is not built (``../shared/gpu/install.sh`` imports this name)."""
    try:
        return extension()
    except ImportError:
        return None


def make_draft_index(config: DraftIndexConfig, upkeep_thread: bool = False):
    """A draft index for ``config``; ``upkeep_thread``: its upkeep on a thread of its own (the drafts are the same)."""
    index = extension().DraftIndex(config.ngram, config.max_match, config.max_occurrences, config.max_candidates,
                                   config.corpus_bytes, upkeep_thread=upkeep_thread)
    index.config = config
    return index
