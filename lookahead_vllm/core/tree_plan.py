"""The planner: one engine step's draft math, over the whole batch (docs/how-it-works.md, "The drafting pipeline").

Drafts arrive as rows: ``tokens``/``parents``/``raw`` confidences ``[R, W]`` and ``lengths [R]``, parents first (a
chain: node ``i``'s parent is ``i - 1``). Per step the proposer books last step's :class:`TreeOffers` against what
its rows emitted (:meth:`TreeOffers.match`, then :meth:`TreeOffers.observe` into the calibrator), plans this step's
(:func:`plan_trees`) and keeps what it handed out as a :class:`StepDrafts`, which tree verification reads as one
:class:`TreeBatch`. Each is one native call (csrc/draft_index/trees.cpp), held to ``lookahead_lab.reference.planner``
bit for bit.

Example: one verifiable row drafts ``a(-1) b(0) c(-1)`` with raw confidences ``[0.8, 0.5, 0.3]`` (kinds context,
context, branch); with factor 1 and no cost model, a budget of 2 keeps ``a, b`` (a chain: no plan), a budget of 3
all three (a tree: ``c`` opens a second path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from lookahead_vllm.core import native
from lookahead_vllm.core.budget import ForwardCost
from lookahead_vllm.core.calibration import KIND_CONTEXT, KIND_POOL
from lookahead_vllm.core.jacobi import lookahead_parents

if TYPE_CHECKING:
    from lookahead_vllm.core.calibration import ConfidenceCalibrator


@dataclass(frozen=True, slots=True)
class TreeOffers:
    """The drafts the planner handed out in one step, one row per drafting request (a tree, or a chain where its
    request may not verify one): booked against what verification accepted in the next step, then replaced."""

    slots: np.ndarray  # [D] int64 request slots, each at most once
    tokens: np.ndarray  # [D, W] int32 node tokens
    parents: np.ndarray  # [D, W] int32 node parents (-1: the root), parents first
    raw: np.ndarray  # [D, W] float64 raw (uncalibrated) node confidences
    kinds: np.ndarray  # [D, W] int8 calibration kinds
    lengths: np.ndarray  # [D] int64 nodes handed out (0: none)
    trees: np.ndarray  # [D] bool: the row's draft is a tree (tree_verify verifies it)

    @classmethod
    def none(cls) -> "TreeOffers":
        empty = np.zeros((0, 0), np.int32)
        return cls(np.zeros(0, np.int64), empty, empty, np.zeros((0, 0)), np.zeros((0, 0), np.int8),
                   np.zeros(0, np.int64), np.zeros(0, bool))

    def match(self, slots: np.ndarray, scheduled: np.ndarray, emitted: list[list[int]]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This step's rows (``slots``; ``scheduled``: draft tokens the scheduler verified; ``emitted``: the tokens
        each row emitted) against the offers. Per row that verified part of its offer, in row order: the offer's
        index and the nodes verified (at most the offer's length); and ``hits [D, W]``: the verified nodes accepted."""
        return native.extension().match_trees(self.slots, self.lengths, self.tokens, self.parents, slots,
                                              scheduled, emitted)

    def observe(self, calibrator: "ConfidenceCalibrator", at: np.ndarray, verified: np.ndarray,
                hits: np.ndarray) -> tuple[int, int]:
        """Book offer ``at[i]``'s first ``verified[i]`` nodes, in order, into the calibrator (:meth:`match`'s
        results); returns how many accepted nodes were context nodes and how many Jacobi pool nodes."""
        calibrator.observe_trees(self.raw, self.kinds, hits, at, verified)
        return (int(np.count_nonzero(hits[self.kinds == KIND_CONTEXT])),
                int(np.count_nonzero(hits[self.kinds == KIND_POOL])))


@dataclass(frozen=True, slots=True, eq=False)
class TreeBatch:
    """Plans of one step as rows of arrays (what tree verification reads): row ``t`` holds ``lengths[t]`` nodes,
    parents first (-1: the root; a tree's nodes in DFS order, so any prefix the scheduler keeps is a tree), of which
    the first ``verify[t]`` may be accepted and the rest are a Jacobi window's lookahead nodes (never accepted:
    their outputs refill the window and its pool; docs/how-it-works.md, "Tree verification")."""

    tokens: np.ndarray  # [T, W] int32 (0 past a row's length)
    parents: np.ndarray  # [T, W] int32 (-1 past a row's length)
    lengths: np.ndarray  # [T] int64
    verify: np.ndarray  # [T] int64

    def __len__(self) -> int:
        return len(self.lengths)

    def take(self, keep: np.ndarray) -> "TreeBatch":
        """The rows ``keep`` (indices or a mask), in that order."""
        return TreeBatch(self.tokens[keep], self.parents[keep], self.lengths[keep], self.verify[keep])

    def depths(self) -> np.ndarray:
        """``[T, W]`` int64: every node's depth (the root's children 1; 0 past a row's length)."""
        count, width = self.parents.shape
        depth = np.zeros((count, width), np.int64)
        rows = np.arange(count)
        for j in range(width):  # parents come first: a node's parent's depth is known
            p = self.parents[:, j]
            depth[:, j] = np.where(p < 0, 1, depth[rows, np.maximum(p, 0)] + 1)
        return np.where(np.arange(width) < self.lengths[:, None], depth, 0)

    def chain_prefix(self) -> np.ndarray:
        """``[T]`` int64: each row's leading nodes that form a chain from the root."""
        count, width = self.parents.shape
        off = (self.parents != np.arange(-1, width - 1)) | (np.arange(width) >= self.lengths[:, None])
        off = np.concatenate([off, np.ones((count, 1), bool)], axis=1)
        return np.argmax(off, axis=1).astype(np.int64)

    def is_chain(self, prefix: np.ndarray | None = None) -> np.ndarray:
        """``[T]`` bool: the row is a chain of verify nodes (vLLM's chain verification applies); ``prefix``:
        :meth:`chain_prefix`, where the caller has it."""
        prefix = self.chain_prefix() if prefix is None else prefix
        return (self.verify == self.lengths) & (prefix == self.lengths)

    def visibility(self, size: int) -> np.ndarray:
        """``[T, size, size]`` bool over each plan's rows (the root, then its nodes; ``size > max(lengths)``): row ``i``
        sees row ``j`` iff ``j`` is the root, ``i``, or an ancestor of ``i`` (False past a row's length)."""
        count, width = self.parents.shape
        vis = np.zeros((count, size, size), bool)
        vis[:, :, 0] = True
        rows = np.arange(count)
        for j in range(min(width, size - 1)):  # nodes past every row's length see nothing
            p = self.parents[:, j]
            vis[:, j + 1, 1:] = np.where((p >= 0)[:, None], vis[rows, np.maximum(p, 0) + 1, 1:], False)
            vis[:, j + 1, j + 1] = True
        inside = np.arange(size) <= self.lengths[:, None]
        return vis & inside[:, :, None] & inside[:, None, :]


@dataclass(frozen=True, slots=True, eq=False)
class StepDrafts:
    """What one step handed out, as tree verification reads it in the next (the proposer's only hand-over to
    ``tree_verify``)."""

    offers: TreeOffers  # the planner's, booked against what the rows emit
    rows: dict[str, int]  # request -> its offer row, where it verifies a plan other than a chain
    windows: dict[int, tuple[int, ...]]  # offer row -> its Jacobi window's lookahead tokens, in plan order
    window: int = 0  # every window's shape: columns, n-gram size
    ngram: int = 0

    @classmethod
    def none(cls) -> "StepDrafts":
        return cls(TreeOffers.none(), {}, {})

    def batch(self, req_ids: Sequence[str], counts: np.ndarray) -> tuple[TreeBatch, np.ndarray]:
        """The plans of ``req_ids`` (each with a row: ``req_id in rows``), each cut to its first ``counts[i]`` nodes
        (what the scheduler kept), as one :class:`TreeBatch` (the offer's kept nodes, then its window's lookahead
        nodes, parents as ``lookahead_parents``), and each whole plan's nodes (more than ``counts[i]``: it was cut)."""
        offers = self.offers
        d = np.fromiter(map(self.rows.__getitem__, req_ids), np.int64, len(req_ids))
        kept = offers.lengths[d]
        ahead = [self.windows.get(x) for x in d.tolist()]
        windowed = np.fromiter((a is not None for a in ahead), bool, len(ahead))
        nodes = len(next((a for a in ahead if a is not None), ()))
        full = kept + nodes * windowed
        width = max(1, int(full.max(initial=0)))
        src = min(width, offers.tokens.shape[1])
        # The offers' cells past their kept nodes are overwritten by a window or cut below.
        tokens = np.zeros((len(d), width), np.int32)
        parents = np.full((len(d), width), -1, np.int32)
        tokens[:, :src], parents[:, :src] = offers.tokens[d, :src], offers.parents[d, :src]
        if nodes:
            w = np.flatnonzero(windowed)
            at = kept[w, None] + np.arange(nodes)
            tokens[w[:, None], at] = np.array([ahead[i] for i in w.tolist()], np.int32)
            base = np.asarray(lookahead_parents(self.window, self.ngram), np.int32)
            parents[w[:, None], at] = np.where(base >= 0, base + kept[w, None], -1)
        lengths = np.minimum(full, np.asarray(counts, np.int64))
        within = np.arange(width) < lengths[:, None]
        trees = TreeBatch(np.where(within, tokens, 0).astype(np.int32),
                          np.where(within, parents, -1).astype(np.int32), lengths, np.minimum(kept, lengths))
        return trees, full


def index_within(lengths: np.ndarray) -> np.ndarray:
    """For segments of ``lengths`` laid end to end, each element's index within its segment."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def plan_trees(
    tokens: np.ndarray, parents: np.ndarray, raw: np.ndarray, lengths: np.ndarray, tree_ok: np.ndarray,
    calibrator: "ConfidenceCalibrator", budget: int | None, num_rows: int, cost: ForwardCost,
    slots: np.ndarray, out_rows: np.ndarray, num_out: int, kinds: np.ndarray | None = None,
    entry: np.ndarray | None = None,
) -> tuple[TreeOffers, np.ndarray, list[list[int]]]:
    """Calibrate every node (kind ``KIND_CONTEXT`` on the leading chain, ``KIND_BRANCH`` off it) and keep the batch's
    merged prefix that maximises expected tokens per forward (core/budget.py). Row ``r`` of ``tokens``/``parents``/
    ``raw [R, W]`` holds the draft index's tree of ``lengths[r]`` nodes for request ``slots[r]`` at batch row
    ``out_rows[r]``; ``tree_ok[r]``: whether it may verify a tree (else it keeps its best path). With ``kinds [R, W]``
    given (merged sources: ``Drafter.draft``), the rows are planned as they are, already cut to what their requests
    may verify. ``entry [R]``: what a row pays, in forwards, once it keeps any node (``ForwardCost.entry`` of its
    context; None: nothing). Returns the offers (each row's kept prefix), the calibrated confidences of the offered
    rows (cells past a row's length unspecified) and the ``num_out`` batch rows' drafts (``[]`` where none)."""
    tok, par, conf, out_kinds, keep, calibrated, trees, drafts = native.extension().plan_trees(
        tokens, parents, raw, lengths, np.asarray(tree_ok, bool), calibrator.bin_edges, calibrator.factor_table(),
        -1 if budget is None else budget, num_rows, cost.free_tokens, float(cost.marginal_tokens),
        float(cost.per_path), float(cost.path_setup), float(cost.draft_setup), out_rows, num_out, kinds, entry)
    offers = TreeOffers(np.asarray(slots, np.int64), tok, par, conf, out_kinds, keep, trees.astype(bool))
    return offers, calibrated, drafts
