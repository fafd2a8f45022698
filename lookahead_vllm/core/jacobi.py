"""Jacobi lookahead decoding (seeds 001 and 004): the 2D window and the n-gram pool.

Terms (digest sections 2 and 5):
  W, N, G    window columns, n-gram size (the window keeps N - 1 levels), and
             the most pool n-grams verified per step (also the most kept per
             key).
  window     per request, ``rows[0]`` holds W - 1 tokens (columns 1..W-1;
             column 0 of level 0 is x0, the last committed token) and
             ``rows[l]`` for l = 1..N-2 hold W tokens each.
  lookahead  the window's nodes in a step plan. Node (l, i) sits at position
             p + l + i and sees x0, (0, 1..i) and (1..l, i): exactly its
             ancestors if (l, i)'s parent is (l-1, i), (1, 0)'s and (0, 1)'s
             parent is x0 and (0, i)'s is (0, i-1). So the window is a token
             tree rooted at x0, verified by the same tree attention as the trie's
             drafts; its nodes are never accepted.
  new tokens the target's argmax at the N-2 level (at x0 for column 0 when
             N = 2): one new token per column, for position p + N - 1 + i.
  n-grams    column i yields ((0, i), (1, i), ..., (N-2, i), new_i), keyed by
             its first token ((0, 0) = x0). The pool keeps, per key, the G most
             recently seen continuations (LRU).
  verify     up to G pool n-grams keyed by x0 become draft branches from x0,
             merged with the trie's tree (shared prefixes merged).

Layout for W = 5, N = 4 (x0 at position p, lookahead nodes in plan order)::

    level 0:   x0   (0,1) (0,2) (0,3) (0,4)        positions p .. p+4
    level 1: (1,0) (1,1) (1,2) (1,3) (1,4)         positions p+1 .. p+5
    level 2: (2,0) (2,1) (2,2) (2,3) (2,4)         positions p+2 .. p+6

After the forward, the slide drops level 0's first column and level 0 itself:
``rows = [rows[1][1:], rows[2], new]``.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from lookahead_vllm.core.budget import ForwardCost
from lookahead_vllm.core.draft_tree import rows_of

# Draft confidence given to a pool n-gram's node at depth d (the pool has no
# counts; Jacobi n-grams are right roughly this often on chat text).
POOL_CONFIDENCE = 0.5


class NgramPool:
    """First token -> up to ``max_per_key`` continuations of ``n - 1`` tokens, LRU."""

    def __init__(self, n: int, max_per_key: int) -> None:
        self.n = n
        self.max_per_key = max_per_key
        # Per key its continuations, least recently seen first (a dict keeps insertion order).
        self._pool: dict[int, dict[tuple[int, ...], None]] = {}
        self.num_added = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())

    def add(self, ngram: Sequence[int]) -> None:
        if len(ngram) != self.n:
            raise ValueError(f"n-gram {tuple(ngram)} has {len(ngram)} tokens; the pool holds {self.n}-grams")
        self.extend([tuple(int(t) for t in ngram)])

    def extend(self, grams: Sequence[tuple[int, ...]]) -> None:
        """:meth:`add` for many n-grams, in order, each already a tuple of ``n`` ints (the window's
        columns: :meth:`JacobiWindow.update`)."""
        pool, cap = self._pool, self.max_per_key
        for gram in grams:
            entries = pool.get(gram[0])
            if entries is None:
                entries = pool[gram[0]] = {}
            cont = gram[1:]
            if cont in entries:
                del entries[cont]
            elif len(entries) >= cap:  # full: the least recently seen goes
                del entries[next(iter(entries))]
            entries[cont] = None  # most recently seen last
        self.num_added += len(grams)

    def get(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """Continuations of ``key``, most recently seen first."""
        found = list(reversed(self._pool.get(int(key), ())))
        return found if limit is None else found[:limit]


@lru_cache(maxsize=256)
def lookahead_parents(window: int, ngram: int, base: int = 0) -> tuple[int, ...]:
    """Parent of every lookahead node in plan order (-1 = x0), see the module
    docstring; after ``base`` nodes of a verify tree, their indices shifted by it."""
    parents = [-1 if i == 1 else i - 2 for i in range(1, window)]  # (0, 1..W-1)
    for level in range(1, ngram - 1):
        for col in range(window):
            parents.append(_index(level - 1, col, window))
    return tuple(p if p < 0 else p + base for p in parents)


def _index(level: int, col: int, window: int) -> int:
    """Plan index of node (level, col) among the lookahead nodes; -1 for x0."""
    if level == 0:
        return col - 1
    return window - 1 + (level - 1) * window + col


def output_nodes(window: int, ngram: int) -> list[int]:
    """Per column, the lookahead node whose output is the column's new token (-1 = x0)."""
    return [_index(ngram - 2, col, window) for col in range(window)]


@dataclass
class JacobiWindow:
    """One request's 2D window (see the module docstring)."""

    window: int
    ngram: int
    rows: list[list[int]]

    @classmethod
    def from_prompt(cls, prompt: Sequence[int], window: int, ngram: int, seed: int = 0) -> "JacobiWindow":
        """Every level filled with tokens drawn from the prompt (seeded: rebuilt identically)."""
        rng = random.Random(seed)
        pick = list(prompt) or [0]
        rows = [[rng.choice(pick) for _ in range(window - 1)]]
        rows += [[rng.choice(pick) for _ in range(window)] for _ in range(ngram - 2)]
        return cls(window, ngram, rows)

    @property
    def num_nodes(self) -> int:
        return self.window * (self.ngram - 1) - 1

    def tokens(self) -> list[int]:
        """Lookahead node tokens in plan order."""
        return [t for row in self.rows for t in row]

    def update(self, x0: int, new: Sequence[int]) -> list[tuple[int, ...]]:
        """Take the step's new tokens (one per column): return the column n-grams, slide."""
        if len(new) != self.window:
            raise ValueError(f"{len(new)} new tokens for a window of {self.window} columns")
        new = [int(t) for t in new]
        grams = list(zip([int(x0), *self.rows[0]], *self.rows[1:], new))  # column i, top level down
        full = [*self.rows, new]
        self.rows = [full[1][1:], *full[2:]]
        return grams


def pool_rows(found: Sequence[Sequence[Sequence[int]]], length: int) -> tuple[np.ndarray, ...]:
    """Row ``d`` holds ``found[d]``'s pool continuations (each ``length``
    tokens) as branches from the root, side by side, each node at confidence
    and weight ``POOL_CONFIDENCE ** depth``, as
    :func:`~lookahead_vllm.core.draft_tree.rows_of` arrays: branches of one
    length give every row the same parents and confidences by column, so
    only the tokens are written row by row (reference:
    ``lookahead_lab.reference.planner.branch_tree`` per row)."""
    counts = np.fromiter(map(len, found), np.int64, len(found))
    width = max(1, int(counts.max(initial=0)) * length)
    out = rows_of(len(found), width)
    tokens, parents, weights, conf, lengths = out
    col = np.arange(width)
    lengths[:] = counts * length
    inside = col < lengths[:, None]
    parents[:] = np.where(inside & (col % length != 0), col - 1, -1)
    weights[:] = np.where(inside, POOL_CONFIDENCE ** (col % length + 1), 0.0)
    conf[:] = weights
    for d in np.flatnonzero(counts).tolist():
        tokens[d, :lengths[d]] = [t for branch in found[d] for t in branch]
    return out


# Adaptive window: a request's expected pool tokens per window step starts
# at YIELD_PRIOR and follows a moving average (weight YIELD_ALPHA); a window
# that does not pay is still sent after PROBE_EVERY steps to re-measure it,
# and each probe that brings nothing doubles that wait (up to MAX_PROBE_EVERY).
YIELD_PRIOR = 1.0
YIELD_ALPHA = 0.25
PROBE_EVERY = 32
MAX_PROBE_EVERY = 512


@dataclass
class JacobiRequest:
    """One request's Jacobi state in the proposer: its window and n-gram pool.

    The window is sent when its expected yield (``yield_est``: accepted pool
    tokens per step with the window) pays for its tokens (core/budget.py), or
    as a probe; the pool serves verify branches either way.
    """

    window: JacobiWindow
    pool: NgramPool
    # Set when a plan with the window goes out: x0 and the first pool node
    # (verify nodes from this index on came from the pool, not the trie).
    x0: int = -1
    pool_from: int = 0
    yield_est: float = YIELD_PRIOR
    steps_without: int = 0
    probe_every: int = PROBE_EVERY
    # The window in flight was sent as a probe (it did not pay by yield_est).
    probing: bool = False

    def wants_window(self, need: float) -> bool:
        """Whether to send the window when it must yield ``need`` tokens to pay."""
        pays = self.yield_est >= need
        if pays or self.steps_without >= self.probe_every:
            self.steps_without, self.probing = 0, not pays
            return True
        self.steps_without += 1
        return False

    def credit(self, pool_tokens: int) -> None:
        """Book one step with the window that accepted ``pool_tokens`` pool tokens."""
        self.yield_est += YIELD_ALPHA * (pool_tokens - self.yield_est)
        if pool_tokens:
            self.probe_every = PROBE_EVERY
        elif self.probing:
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
        self.probing = False

    @classmethod
    def from_prompt(
        cls, prompt: Sequence[int], window: int, ngram: int, guesses: int,
        yield_est: float = YIELD_PRIOR, probe_every: int = PROBE_EVERY,
    ) -> "JacobiRequest":
        """Window deterministic in the prompt (a recomputed request gets the same one);
        ``yield_est``, ``probe_every``: what earlier requests learned."""
        seed = zlib.crc32(b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt))
        return cls(JacobiWindow.from_prompt(prompt, window, ngram, seed), NgramPool(ngram, guesses),
                   yield_est=yield_est, probe_every=probe_every)

    def update(self, new: Sequence[int]) -> int:
        """Feed the step's new tokens; return how many n-grams went into the pool."""
        grams = self.window.update(self.x0, new)
        self.pool.extend(grams)
        return len(grams)


@dataclass(slots=True)
class WindowStep:
    """The step the windows join (core/budget.py's units): ``tokens`` scored, ``extra``
    attention paths, the draft ``setup`` still unpaid (0 once the step carries a draft),
    the entry ``fees`` its drafted rows pay, and the tokens it is expected to emit (``gain``)."""

    tokens: int
    extra: int
    setup: float
    fees: float
    gain: float


def choose_windows(windows: Sequence[JacobiRequest], fees: np.ndarray, step: WindowStep,
                   cost: ForwardCost) -> list[int]:
    """Which of a step's ``windows`` go out, in the order they join it (indices into
    ``windows``): most expected yield first, each one sent when its yield pays for
    what its nodes and column paths add to the step (``fees[i]``: the entry it pays
    too) given the windows sent before it, or when its probe is due (each window asked
    :meth:`JacobiRequest.wants_window` once), and ``step`` ends as the step with them
    (reference: ``lookahead_lab.reference.planner.choose_windows``). Every window has
    the same shape (one configuration), so the step's cost with ``m`` windows is
    priced once for every ``m``, in one call."""
    n = len(windows)
    if not n:
        return []
    nodes, cols = windows[0].window.num_nodes, windows[0].window.window
    m = np.arange(n + 1)
    costs = cost.many(step.tokens + m * nodes, step.extra + m * cols).tolist()
    fee = np.asarray(fees, np.float64).tolist()
    sent: list[int] = []
    setup, paid, gain = step.setup, step.fees, step.gain
    for i in sorted(range(n), key=lambda i: -windows[i].yield_est):
        w, k = windows[i], len(sent)
        if w.wants_window(gain * ((costs[k + 1] + setup + paid + fee[i]) / (costs[k] + paid) - 1.0)):
            sent.append(i)
            setup, paid, gain = 0.0, paid + fee[i], gain + w.yield_est
    k = len(sent)
    step.tokens, step.extra, step.setup, step.fees, step.gain = (step.tokens + k * nodes, step.extra + k * cols,
                                                                 setup, paid, gain)
    return sent
