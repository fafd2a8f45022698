"""Draft index settings. The index drafts the tokens that followed the longest earlier match of a request's trailing
tokens, in its own text and in every request's output, for a whole batch in one call; it is native
(``csrc/draft_index/draft_index.cpp``, :func:`lookahead_vllm.core.native.make_draft_index`; terms, charge, upkeep,
partitions and worked examples: docs/how-it-works.md, "The draft index"; reference:
``lookahead_lab.reference.draft_index``). It is deterministic: every tensor-parallel rank drafts the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT, PRIVATE = 0, -1  # partitions: the shared default one, and no partition at all
MAX_PARTITION = (1 << 24) - 1  # the native index keeps a record per id up to the largest seen
# The corpus's charge, in bytes (the native header's kSequenceCharge...).
SEQUENCE_CHARGE, TOKEN_CHARGE, ENTRY_CHARGE, KEY_CHARGE = 256, 8, 40, 48


@dataclass(frozen=True, slots=True)
class DraftIndexConfig:
    """One index's settings, no defaults of its own (``config.Settings.index_config``: the profile's index knobs)."""

    ngram: int  # key length: a candidate must agree on at least this many trailing tokens
    max_match: int  # matches are measured backwards at most this far (tokens)
    max_occurrences: int  # occurrences kept per key (own: per sequence; corpus: across outputs)
    max_candidates: int  # candidates merged into one draft (best-ranked first)
    corpus_bytes: int  # the corpus's cap: its charge in bytes (oldest finished outputs evicted first)

    def __post_init__(self) -> None:
        for name, lo, hi in (("ngram", 1, 4), ("max_match", 1, 1 << 16), ("max_occurrences", 1, 1024),
                             ("max_candidates", 1, 1024), ("corpus_bytes", 0, 1 << 40)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}={value!r}: must be an int in [{lo}, {hi}]")
        if self.max_match < self.ngram:
            raise ValueError(f"max_match={self.max_match!r}: must be >= ngram ({self.ngram})")
