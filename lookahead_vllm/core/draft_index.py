"""Draft index: the drafting core. Drafts the tokens that followed the longest earlier match of a
request's trailing tokens, in its own text and in every request's output, for a whole batch in
one call.

The engine's index is native: ``lookahead_vllm._draft_index`` (``csrc/draft_index/draft_index.cpp``,
built at install time; :func:`lookahead_vllm.core.native.make_draft_index`). This module defines
its terms and settings; tests hold it to the pure-Python reference
``lookahead_lab.reference.draft_index``.

Terms:

  sequence  one request: ``own`` text (prompt + output tokens so far) while it runs; its output
            tokens also join the ``corpus``, and stay there after it finishes (oldest finished
            outputs are evicted first while the corpus's charge is over ``corpus_bytes``).
  key       the last ``ngram`` tokens. ``own`` index: per running sequence, key -> positions of
            the token that followed it (ascending, the ``max_occurrences`` most recent).
            ``corpus`` index: key -> ``(sequence id, position in its output)``, the
            ``max_occurrences`` most recent across all outputs.
  candidate an earlier occurrence of the sequence's current key. Its *match* ``m`` is how far the
            occurrence agrees with the current text backwards (``ngram <= m <= max_match``).
            Candidates are ranked by ``m`` (longest first), then own before corpus, then most
            recent first; the best ``max_candidates`` are kept.
  continuation  the tokens that followed a candidate, at most ``budget``; an own candidate that
            runs into the text's end repeats its period (``a b a b a`` continues ``b a b a``).
  draft     the continuations merged into a token tree. A node's weight ``W`` is the sum of ``m``
            over the candidates through it, ``M`` their largest ``m``; its confidence (estimated
            probability that the root-to-node path is accepted) is::

                (W / W_root) * q(M) ** depth,   q(m) = m / (m + 1)

            ``W / W_root`` is how many of the matches (weighted by length) agree on the path, as
            in suffix decoding's count ratio; ``q`` is Laplace's rule: a text that agreed ``m``
            tokens in a row goes on agreeing with probability ``m / (m + 1)``. Nodes below
            ``floor`` are never drafted. ``tree=False`` drafts the chain that follows the
            heaviest child at every depth (ties: the better-ranked candidate's); ``tree=True``
            picks the ``budget`` most confident nodes (ties: creation order) and flattens them
            depth-first, children by confidence, so every parent precedes its children.

Worked example (``ngram=2``): own text ``a b c d x a b`` ends with key ``a b``, seen at 0..1 and
followed by position 2, with match ``m = 2`` (``x`` before ``a b`` at the end differs from nothing
before position 0). Its continuation for a budget of 3 is ``c d x``, confidences ``(2/3),
(2/3)^2, (2/3)^3``.

Charge: what the corpus's cap bounds, priced per item at what the native layout takes at most
(csrc/draft_index/draft_index.h): each finished output held ``SEQUENCE_CHARGE`` +
``TOKEN_CHARGE`` per token, each corpus entry (an occurrence of any output's n-gram, running or
finished) ``ENTRY_CHARGE``, each distinct corpus key ``KEY_CHARGE``. Only finished outputs are
evicted; running ones are bounded by the engine's KV cache.

Upkeep: the corpus work a step can leave until its drafts are out, namely the pushes of the output
n-grams appended since (in order), then the eviction of the oldest finished outputs while the
charge is over the cap. ``draft_batch`` drafts from the index as it stands and then runs the
pending upkeep (the native index can run it on a thread of its own, while the forward runs);
every other method that reads the corpus (``add``, ``extend``, ``draft``, ``sync``, the corpus
counts, ``rewind``) first settles it. So a request's draft in the step's batch call does not yet
see the n-grams other requests' outputs gained in the same step, nor does a finish evict before
the next upkeep.

Partitions (tenant isolation): every sequence belongs to a *partition*, an int the caller assigns
when it adds the sequence (``DEFAULT`` = 0 unless told otherwise). Corpus keys are ``(partition,
n-gram)``: a sequence drafts from its own text and from outputs of its own partition only, never
from another's. ``PRIVATE`` (-1) is no partition: its outputs never join the corpus (finishing it
forgets it) and it drafts from its own text alone. The charge is kept per partition as well (a
partition's finished outputs, its entries and its keys); the cap bounds the sum, and eviction is
fair between partitions: while over the cap, the oldest finished output of the partition charged
the most goes first (ties: the lowest partition), so one partition's flood evicts its own outputs
before anyone else's.

Worked example: partitions 1 and 2 hold outputs charged 900 and 100 bytes, the cap is 800 and
partition 2 finishes a 200-byte output (total 1200): partition 1 loses its oldest outputs until
the total is back under 800, and partition 2's 300 bytes stay.

Every operation is deterministic, so every tensor-parallel rank drafts the same tokens from the
same inputs (where the upkeep runs never changes them).
"""

from __future__ import annotations

from dataclasses import dataclass

# Partitions (module docstring): the shared default one, and no partition at all.
DEFAULT, PRIVATE = 0, -1
# The largest partition id (the native index keeps a record per id up to the largest seen).
MAX_PARTITION = (1 << 24) - 1
# The corpus's charge, in bytes (module docstring; the native header's kSequenceCharge...).
SEQUENCE_CHARGE, TOKEN_CHARGE, ENTRY_CHARGE, KEY_CHARGE = 256, 8, 40, 48


@dataclass(frozen=True, slots=True)
class DraftIndexConfig:
    """One index's settings; no defaults of its own: the engine builds it from its settings
    (``config.Settings.index_config``, the profile's index knobs)."""

    # Key length: a candidate must agree on at least this many trailing tokens.
    ngram: int
    # Matches are measured backwards at most this far (tokens).
    max_match: int
    # Occurrences kept per key (own: per sequence; corpus: across outputs).
    max_occurrences: int
    # Candidates merged into one draft (best-ranked first).
    max_candidates: int
    # The corpus's cap: its charge in bytes (oldest finished outputs evicted first).
    corpus_bytes: int

    def __post_init__(self) -> None:
        for name, lo, hi in (("ngram", 1, 4), ("max_match", 1, 1 << 16), ("max_occurrences", 1, 1024),
                             ("max_candidates", 1, 1024), ("corpus_bytes", 0, 1 << 40)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}={value!r}: must be an int in [{lo}, {hi}]")
        if self.max_match < self.ngram:
            raise ValueError(f"max_match={self.max_match!r}: must be >= ngram ({self.ngram})")
