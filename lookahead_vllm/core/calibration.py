"""Online calibration of draft confidences from verification outcomes.

The forward-cost model (core/budget.py) keeps a draft node only while its
confidence (the estimated probability that it is accepted) pays for its
cost, so the confidences must be probabilities, not just a ranking. The
trie's are products of smoothed ``P(child | parent)`` counts: about right on
a tree's leading chain, but far too high off it. Replaying 32 prompts per
dataset (``sim_acceptance``, benchmarks/results/sim_acceptance_calibration.json),
side-branch nodes the trie rated 0.2-0.4 were accepted 10-13% of the time,
leading-chain nodes in the same range 24-35%.
The counts mix many contexts, while the target keeps repeating its own
favourite continuation, so the runner-up is rarely right. The Jacobi pool's
n-grams and the context chain's tokens (core/context_match.py) have only
priors (``POOL_CONFIDENCE ** depth``; ``(m / (m + 1)) ** depth`` for a context
match of ``m`` tokens).

The calibrator learns a correction per node *kind* (leading chain, side
branch, pool, context chain) and raw-confidence bin from what verification
accepted::

    calibrated = raw * (accepted + prior) / (predicted + prior)

where ``predicted`` is the sum of the raw confidences of the bin's verified
nodes and ``accepted`` how many of them were accepted. With no data the factor
is 1 (raw confidences); ``prior`` (in accepted tokens) says how much evidence
overrides it. Counts are halved once a bin has seen ``HALF_LIFE_NODES``
nodes, so the correction follows a changing workload. Calibrated confidences
never grow along a path (a node is accepted only with its parent).
The proposer books one step's verified nodes at once (``observe_nodes``, or
``observe_trees`` for the planner's drafts), so halving and the new
factors apply per step.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from lookahead_vllm.core.draft_tree import DraftTree
from lookahead_vllm.core.native import load_extension

KIND_CHAIN, KIND_BRANCH, KIND_POOL, KIND_CONTEXT = 0, 1, 2, 3
KIND_NAMES = ("chain", "branch", "pool", "context")
# Upper edges of the raw-confidence bins (the last bin runs to 1).
BIN_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
HALF_LIFE_NODES = 4096


def node_kinds(tree: DraftTree, pool_from: int | None = None, context: int = 0) -> list[int]:
    """Per node: KIND_CONTEXT for the first ``context`` nodes (the context
    chain, core/context_match.py), KIND_POOL from ``pool_from`` on (Jacobi
    pool n-grams merged after the trie's nodes), else KIND_CHAIN on the
    leading chain (node ``i``'s parent is ``i - 1`` from the root on) and
    KIND_BRANCH off it."""
    pool_from = len(tree) if pool_from is None else pool_from
    kinds, chain = [], True
    for i, p in enumerate(tree.parents):
        chain = chain and p == i - 1
        kind = KIND_CHAIN if chain else KIND_BRANCH
        kinds.append(KIND_CONTEXT if i < context else KIND_POOL if i >= pool_from else kind)
    return kinds


class ConfidenceCalibrator:
    """Per (kind, raw-confidence bin): predicted and accepted totals; see the module docstring."""

    # BIN_EDGES as an array, for the native kernels.
    bin_edges = np.asarray(BIN_EDGES, np.float64)

    def __init__(self, prior: float = 8.0, native: bool = False, learns: bool = True) -> None:
        if prior <= 0:
            raise ValueError(f"prior={prior!r}: must be > 0")
        if native and load_extension() is None:
            raise ImportError("native=True: lookahead_vllm._draft_index is not built (pip install -e .)")
        self.prior = prior
        # False: the factors stay 1 (raw confidences; profile calibrate_confidence off).
        self.learns = learns
        # observe_trees through the native kernel (core/tree_plan.py).
        self.native = native
        shape = (len(KIND_NAMES), len(BIN_EDGES) + 1)
        self.predicted = np.zeros(shape)
        self.accepted = np.zeros(shape)
        self.nodes = np.zeros(shape)
        self._factor = np.ones(shape)

    @staticmethod
    def _bin(confidence: float) -> int:
        return bisect.bisect_left(BIN_EDGES, confidence)

    def calibrate(self, tree: DraftTree, kinds: Sequence[int]) -> list[float]:
        """Calibrated confidence of every node of ``tree`` (parents first)."""
        out: list[float] = []
        for i, (p, kind) in enumerate(zip(tree.parents, kinds)):
            raw = tree.node_confidence(i)
            c = min(1.0, raw * self._factor[kind, self._bin(raw)])
            out.append(c if p < 0 else min(c, out[p]))
        return out

    def factors(self, kind: int) -> np.ndarray:
        """The current correction factor of each raw-confidence bin of ``kind`` (read-only)."""
        view = self._factor[kind]
        view.flags.writeable = False
        return view

    def factor_table(self) -> np.ndarray:
        """The current correction factors, ``[kinds, bins]`` (read-only)."""
        view = self._factor.view()
        view.flags.writeable = False
        return view

    def observe(self, tree: DraftTree, kinds: Sequence[int], accepted: Sequence[int]) -> None:
        """Learn from one verified draft and the nodes of it that were accepted
        (``step_plan.accepted_path``)."""
        hit = set(accepted)
        raw = [tree.node_confidence(i) for i in range(len(kinds))]
        self.observe_nodes(np.asarray(kinds, np.int64), np.asarray(raw, np.float64),
                           np.fromiter((i in hit for i in range(len(kinds))), bool, len(kinds)))

    def observe_nodes(self, kinds: np.ndarray, raw: np.ndarray, accepted: np.ndarray) -> None:
        """Learn from verified nodes, in order: their kinds, raw confidences
        and whether each was accepted (one step's drafts at once, or one draft)."""
        if not len(kinds) or not self.learns:
            return
        width = self.nodes.shape[1]
        cell = np.asarray(kinds, np.int64) * width + np.searchsorted(BIN_EDGES, raw, side="left")
        size = self.nodes.size
        self.predicted += np.bincount(cell, raw, size).reshape(self.predicted.shape)
        self.accepted += np.bincount(cell, accepted, size).reshape(self.accepted.shape)
        self.nodes += np.bincount(cell, None, size).reshape(self.nodes.shape)
        k, b = np.divmod(np.unique(cell), width)
        full = self.nodes[k, b] >= HALF_LIFE_NODES
        for arr in (self.predicted, self.accepted, self.nodes):
            arr[k[full], b[full]] /= 2
        self._factor[k, b] = (self.accepted[k, b] + self.prior) / (self.predicted[k, b] + self.prior)

    def observe_trees(self, raw: np.ndarray, kinds: np.ndarray, accepted: np.ndarray, at: np.ndarray,
                      verified: np.ndarray) -> None:
        """:meth:`observe_nodes` for drafts stored as rows (core/tree_plan.py):
        row ``at[i]`` of ``raw``/``kinds``/``accepted [D, W]`` had its first
        ``verified[i]`` nodes verified, in that order."""
        if not self.learns:
            return
        if self.native:
            load_extension().observe_trees(self.predicted, self.accepted, self.nodes, self._factor, self.bin_edges,
                                           raw, kinds, accepted, at, verified, self.prior, float(HALF_LIFE_NODES))
            return
        nodes = np.arange(raw.shape[1]) < np.asarray(verified)[:, None]
        self.observe_nodes(kinds[at][nodes].astype(np.int64), raw[at][nodes], accepted[at][nodes].astype(bool))

    def summary(self) -> dict[str, list[dict[str, float]]]:
        """Per kind, the bins that saw nodes: range, nodes, mean raw confidence, acceptance rate, factor."""
        out: dict[str, list[dict[str, float]]] = {}
        lows = (0.0, *BIN_EDGES)
        highs = (*BIN_EDGES, 1.0)
        for kind, name in enumerate(KIND_NAMES):
            rows = []
            for b, n in enumerate(self.nodes[kind]):
                if n:
                    rows.append({
                        "low": lows[b], "high": highs[b], "nodes": float(n),
                        "mean_confidence": float(self.predicted[kind, b] / n),
                        "acceptance": float(self.accepted[kind, b] / n), "factor": float(self._factor[kind, b]),
                    })
            out[name] = rows
        return out
