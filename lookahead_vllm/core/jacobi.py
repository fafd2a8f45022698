"""Jacobi lookahead decoding (seeds 001 and 004): the 2D window and the n-gram pool (docs/how-it-works.md,
"Jacobi lookahead"). Every request's window and pool live in the native ``JacobiTable`` (csrc/draft_index/jacobi.h)
by the caller's slot, a whole step's rows per call; reference: ``lookahead_lab.reference.jacobi``.

  W, N, G    window columns, n-gram size (N - 1 levels), most pool n-grams verified per step and kept per key.
  window     level 0 holds W - 1 tokens (column 0 is x0, the last committed token, at position p), levels 1..N-2
             W each; filled from the prompt at admission and after a rewind (node j of plan order: the prompt's
             token at ``splitmix64(seed + j + 1) % len``, ``seed`` the prompt's FNV-1a hash).
  lookahead  the window's nodes in a step plan, a token tree rooted at x0 that is never accepted: node (l, i)
             sits at position p + l + i and its parent is (l-1, i), (0, i-1) on level 0, x0 for (1, 0) and (0, 1).
  new tokens the target's argmax at level N-2 (at x0 for column 0 when N = 2): one per column, for position
             p + N - 1 + i; column i yields the n-gram ((0, i), ..., (N-2, i), new_i), keyed by its first token,
             into the pool (per key the G most recent, LRU). Then the slide drops level 0 and (1, 0): every
             level moves down one and the new tokens become level N-2.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from lookahead_vllm.core import native

if TYPE_CHECKING:
    from lookahead_vllm.core.config import Settings

POOL_CONFIDENCE = 0.5  # a pool n-gram's node at depth d drafts at POOL_CONFIDENCE ** d (the pool has no counts)
# Window policy (docs/how-it-works.md; native kYield*, kProbeEvery): out while its yield (a moving average of weight
# YIELD_ALPHA from YIELD_PRIOR) pays, else every PROBE_EVERY steps, each empty probe doubling that to MAX_PROBE_EVERY.
YIELD_PRIOR = 1.0
YIELD_ALPHA = 0.25
PROBE_EVERY = 32
MAX_PROBE_EVERY = 512


def make_jacobi(config: "Settings") -> Any:
    """The native Jacobi table for ``config``'s profile (window, n-gram, guesses)."""
    p = config.profile
    return native.extension().JacobiTable(p.jacobi_window, p.jacobi_ngram, p.jacobi_guesses)


@lru_cache(maxsize=256)
def lookahead_parents(window: int, ngram: int, base: int = 0) -> tuple[int, ...]:
    """Parent of every lookahead node in plan order (-1 = x0); after ``base`` nodes of a verify tree, shifted by it."""
    parents = [-1 if i == 1 else i - 2 for i in range(1, window)]  # (0, 1..W-1)
    parents += [_index(level - 1, col, window) for level in range(1, ngram - 1) for col in range(window)]
    return tuple(p if p < 0 else p + base for p in parents)


def _index(level: int, col: int, window: int) -> int:
    """Plan index of node (level, col) among the lookahead nodes; -1 for x0."""
    return col - 1 if level == 0 else window - 1 + (level - 1) * window + col


def output_nodes(window: int, ngram: int) -> list[int]:
    """Per column, the lookahead node whose output is the column's new token (-1 = x0)."""
    return [_index(ngram - 2, col, window) for col in range(window)]
