"""Pure-Python reference of the extension's ``JacobiTable`` (``csrc/draft_index/jacobi.cpp``):
every request's Jacobi window and n-gram pool by slot, with the extension's methods and
array signatures, built one request at a time from :class:`JacobiWindow`,
:class:`NgramPool` and :class:`JacobiRequest` (``lookahead_vllm/core/jacobi.py``'s
docstring defines the window, its slide, the pool and the window policy). Tests hold the
native table to this one: the same windows, pools, draft rows, choices and yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lookahead_vllm.core.drafter import rows_of
from lookahead_lab.reference.trees import DraftTree, fill_row
from lookahead_vllm.core.jacobi import (MAX_PROBE_EVERY, POOL_CONFIDENCE, PROBE_EVERY, YIELD_ALPHA, YIELD_PRIOR,
                                        lookahead_parents)

_M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """splitmix64's step and finalizer, on 64-bit unsigned ints."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def prompt_seed(prompt: Sequence[int]) -> int:
    """FNV-1a (64 bits) over the prompt's tokens, each as 4 little-endian bytes."""
    h = 0xCBF29CE484222325
    for t in prompt:
        t = int(t) & 0xFFFFFFFF
        for b in range(4):
            h = ((h ^ ((t >> (8 * b)) & 0xFF)) * 0x100000001B3) & _M64
    return h


class NgramPool:
    """First token -> up to ``max_per_key`` continuations of ``n - 1`` tokens, LRU."""

    def __init__(self, n: int, max_per_key: int) -> None:
        self.n = n
        self.max_per_key = max_per_key
        # Per key its continuations, least recently seen first (a dict keeps insertion order).
        self._pool: dict[int, dict[tuple[int, ...], None]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())

    def add(self, ngram: Sequence[int]) -> None:
        if len(ngram) != self.n:
            raise ValueError(f"n-gram {tuple(ngram)} has {len(ngram)} tokens; the pool holds {self.n}-grams")
        entries = self._pool.setdefault(int(ngram[0]), {})
        cont = tuple(int(t) for t in ngram[1:])
        if cont in entries:
            del entries[cont]
        elif len(entries) >= self.max_per_key:  # full: the least recently seen goes
            del entries[next(iter(entries))]
        entries[cont] = None  # most recently seen last

    def get(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """Continuations of ``key``, most recently seen first."""
        found = list(reversed(self._pool.get(int(key), ())))
        return found if limit is None or limit < 0 else found[:limit]


@dataclass
class JacobiWindow:
    """One request's 2D window: ``rows[0]`` holds W - 1 tokens (columns 1..W-1), ``rows[l]``
    for l = 1..N-2 hold W tokens each."""

    window: int
    ngram: int
    rows: list[list[int]]

    @classmethod
    def from_prompt(cls, prompt: Sequence[int], window: int, ngram: int) -> "JacobiWindow":
        """Node ``j`` in plan order is ``prompt[splitmix64(seed + j + 1) % len(prompt)]``
        (0 for an empty prompt), ``seed`` the prompt's :func:`prompt_seed`."""
        seed, n = prompt_seed(prompt), len(prompt)
        nodes = window * (ngram - 1) - 1
        flat = [int(prompt[splitmix64((seed + j + 1) & _M64) % n]) if n else 0 for j in range(nodes)]
        rows = [flat[:window - 1]] + [flat[window - 1 + l * window:window - 1 + (l + 1) * window]
                                      for l in range(ngram - 2)]
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


@dataclass
class JacobiRequest:
    """One slot's record: its window (None: it may not verify a tree) and pool, the
    root its window rides on this step (``x0``, -1: none), the first pool node of its
    offer, and the window policy (``wants_window``, ``credit``)."""

    length: int
    window: JacobiWindow | None
    pool: NgramPool
    yield_est: float = YIELD_PRIOR
    probe_every: int = PROBE_EVERY
    x0: int = -1
    pool_from: int = 0
    steps_without: int = 0
    probing: bool = False

    def wants_window(self, need: float) -> bool:
        """Whether to send the window when it must yield ``need`` tokens to pay (or a probe is due)."""
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


def branch_tree(branches: Sequence[Sequence[int]]) -> DraftTree:
    """Pool continuations as branches from the root, side by side, each node at
    confidence and weight ``POOL_CONFIDENCE ** depth``: one row of
    :meth:`JacobiTable.pool_rows`."""
    tokens: list[int] = []
    parents: list[int] = []
    confs: list[float] = []
    for branch in branches:
        for depth, token in enumerate(branch, start=1):
            parents.append(-1 if depth == 1 else len(tokens) - 1)
            tokens.append(int(token))
            confs.append(POOL_CONFIDENCE ** depth)
    return DraftTree(tuple(tokens), tuple(parents), tuple(confs), tuple(confs))


def with_lookahead(tree: DraftTree, window: JacobiWindow) -> tuple[DraftTree, tuple[bool, ...]]:
    """The verify ``tree`` followed by the window's lookahead nodes, and the per-node lookahead flags:
    ``lookahead_vllm.core.tree_plan.StepDrafts.plan``'s plan of a window row."""
    base = len(tree)
    toks = tuple(window.tokens())
    zeros = (0.0,) * len(toks)
    combined = DraftTree(
        tree.tokens + toks,
        tree.parents + lookahead_parents(window.window, window.ngram, base),
        tree.weights + zeros,
        (tree.confidence or (1.0,) * base) + zeros,
    )
    return combined, (False,) * base + (True,) * len(toks)


class JacobiTable:
    """The extension's ``JacobiTable``, one request at a time."""

    def __init__(self, window: int, ngram: int, guesses: int) -> None:
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.prior: tuple[float, int] = (YIELD_PRIOR, PROBE_EVERY)
        self._slots: dict[int, JacobiRequest] = {}

    @property
    def num_nodes(self) -> int:
        return self.window * (self.ngram - 1) - 1

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def memory_bytes(self) -> int:
        """An estimate (the native table counts its containers' capacities): 4 bytes a window or pool token."""
        return sum(4 * (self.num_nodes if rec.window is not None else 0) + 4 * self.ngram * len(rec.pool)
                   for rec in self._slots.values())

    def track(self, slots: Sequence[int], num_tokens: Sequence[int]) -> np.ndarray:
        stale = []
        for i, (slot, n) in enumerate(zip(np.asarray(slots).tolist(), np.asarray(num_tokens).tolist())):
            rec = self._slots.get(slot)
            if rec is not None:
                rec.x0 = -1
            if rec is None or n < rec.length:
                stale.append(i)
                continue
            rec.length = n
        return np.array(stale, np.int64)

    def open(self, slots, rows, token_ids: np.ndarray, prompt_lens, lengths, windowed) -> None:
        for slot, row, end, length, win in zip(*(np.asarray(a).tolist() for a in (slots, rows, prompt_lens, lengths,
                                                                                  windowed))):
            prompt = token_ids[row, :end].tolist()
            window = JacobiWindow.from_prompt(prompt, self.window, self.ngram) if win else None
            self._slots[slot] = JacobiRequest(length, window, NgramPool(self.ngram, self.guesses), *self.prior)

    def finish(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def _windowed(self, slot: int) -> JacobiRequest | None:
        rec = self._slots.get(int(slot))
        return rec if rec is not None and rec.window is not None else None

    def pool_rows(self, slots, lasts, full) -> tuple[tuple[np.ndarray, ...], int]:
        found = []
        for slot, last, whole in zip(*(np.asarray(a).tolist() for a in (slots, lasts, full))):
            rec = self._windowed(slot)
            if rec is None:
                found.append([])
                continue
            rec.x0 = last if whole else -1
            found.append(rec.pool.get(last, self.guesses))
        length = self.ngram - 1
        out = rows_of(len(found), max(1, max(map(len, found), default=0) * length))
        for d, branches in enumerate(found):
            if branches:
                fill_row(out, d, branch_tree(branches))
        return out, sum(map(len, found))

    def set_pool_from(self, slots, pool_from) -> None:
        for slot, start in zip(np.asarray(slots).tolist(), np.asarray(pool_from).tolist()):
            rec = self._windowed(slot)
            if rec is not None:
                rec.pool_from = start

    def choose(self, slots, fees, costs, setup: float, fees_paid: float, gain: float
               ) -> tuple[np.ndarray, np.ndarray]:
        """Most expected yield first, each riding window asked ``wants_window`` with what it
        must yield to pay for its nodes and column paths (``costs[m]``: the step with m
        windows) given the windows sent before it."""
        fees, costs = np.asarray(fees, np.float64).tolist(), np.asarray(costs, np.float64).tolist()
        riding = [(i, rec) for i, slot in enumerate(np.asarray(slots).tolist())
                  if (rec := self._windowed(slot)) is not None and rec.x0 >= 0]
        riding.sort(key=lambda item: -item[1].yield_est)
        chosen, paid = [], fees_paid
        for i, rec in riding:
            k = len(chosen)
            if rec.wants_window(gain * ((costs[k + 1] + setup + paid + fees[i]) / (costs[k] + paid) - 1.0)):
                chosen.append(i)
                setup, paid, gain = 0.0, paid + fees[i], gain + rec.yield_est
        ahead = np.zeros((len(chosen), self.num_nodes), np.int32)
        for c, i in enumerate(chosen):
            ahead[c] = self._windowed(np.asarray(slots)[i]).window.tokens()
        return np.array(chosen, np.int64), ahead

    def update(self, slots, new_tokens, nodes, starts) -> int:
        new_tokens, nodes, starts = np.asarray(new_tokens), np.asarray(nodes).tolist(), np.asarray(starts).tolist()
        added = 0
        for i, slot in enumerate(np.asarray(slots).tolist()):
            rec = self._windowed(slot)
            if rec is None:
                continue
            for gram in rec.window.update(rec.x0, new_tokens[i].tolist()):
                rec.pool.add(gram)
                added += 1
            rec.credit(sum(1 for n in nodes[starts[i]:starts[i + 1]] if n >= rec.pool_from))
            self.prior = (rec.yield_est, rec.probe_every)
        return added

    def window_tokens(self, slot: int) -> list[int] | None:
        rec = self._windowed(slot)
        return None if rec is None else rec.window.tokens()

    def pool(self, slot: int, key: int, limit: int = -1) -> list[tuple[int, ...]] | None:
        rec = self._windowed(slot)
        return None if rec is None else rec.pool.get(key, limit)

    def pool_size(self, slot: int) -> int:
        rec = self._windowed(slot)
        return -1 if rec is None else len(rec.pool)

    def policy(self, slot: int) -> dict | None:
        rec = self._slots.get(int(slot))
        if rec is None:
            return None
        return {"length": rec.length, "windowed": rec.window is not None, "x0": rec.x0, "pool_from": rec.pool_from,
                "yield_est": rec.yield_est, "steps_without": rec.steps_without, "probe_every": rec.probe_every,
                "probing": rec.probing}

    def credit(self, slot: int, pool_tokens: int) -> None:
        rec = self._windowed(slot)
        if rec is None:
            raise KeyError(f"slot {slot} has no window")
        rec.credit(pool_tokens)
