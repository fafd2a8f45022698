"""Online calibration of draft confidences, which the cost model (core/budget.py) needs to be probabilities
(docs/how-it-works.md, "Forward-cost model"). Per node *kind* (:data:`KIND_NAMES`) and raw-confidence bin::

    calibrated = raw * (accepted + prior) / (predicted + prior)

``predicted``: the sum of the raw confidences of the bin's verified nodes; ``accepted``: how many of them were
accepted (``prior`` in accepted tokens). Counts halve once a bin has seen ``HALF_LIFE_NODES`` nodes; calibrated
confidences never grow along a path. Native; reference: ``lookahead_lab.reference.planner``.
"""

from __future__ import annotations

import numpy as np

from lookahead_vllm.core import native

KIND_CHAIN, KIND_BRANCH, KIND_POOL, KIND_CONTEXT = 0, 1, 2, 3
KIND_NAMES = ("chain", "branch", "pool", "context")
BIN_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # upper edges (the last bin runs to 1)
HALF_LIFE_NODES = 4096


class ConfidenceCalibrator:
    """Per (kind, raw-confidence bin): predicted and accepted totals; see the module docstring."""

    bin_edges = np.asarray(BIN_EDGES, np.float64)  # for the native kernels

    def __init__(self, prior: float = 8.0, learns: bool = True) -> None:
        if prior <= 0:
            raise ValueError(f"prior={prior!r}: must be > 0")
        self.prior = prior
        self.learns = learns  # False: the factors stay 1 (profile calibrate_confidence off)
        shape = (len(KIND_NAMES), len(BIN_EDGES) + 1)
        self.predicted = np.zeros(shape)
        self.accepted = np.zeros(shape)
        self.nodes = np.zeros(shape)
        self._factor = np.ones(shape)

    def factor_table(self) -> np.ndarray:
        """The current correction factors, ``[kinds, bins]`` (read-only)."""
        view = self._factor.view()
        view.flags.writeable = False
        return view

    def observe_trees(self, raw: np.ndarray, kinds: np.ndarray, accepted: np.ndarray, at: np.ndarray,
                      verified: np.ndarray) -> None:
        """Learn from verified drafts stored as rows (core/tree_plan.py), in order: row ``at[i]`` of ``raw``
        confidences, ``kinds`` and ``accepted [D, W]`` had its first ``verified[i]`` nodes verified."""
        if self.learns:
            native.extension().observe_trees(self.predicted, self.accepted, self.nodes, self._factor, self.bin_edges,
                                             raw, kinds, accepted, at, verified, self.prior, float(HALF_LIFE_NODES))

    def summary(self) -> dict[str, list[dict[str, float]]]:
        """Per kind, the bins that saw nodes: range, nodes, mean raw confidence, acceptance rate, factor."""
        lows, highs = (0.0, *BIN_EDGES), (*BIN_EDGES, 1.0)
        return {name: [{"low": lows[b], "high": highs[b], "nodes": float(n),
                        "mean_confidence": float(self.predicted[kind, b] / n),
                        "acceptance": float(self.accepted[kind, b] / n), "factor": float(self._factor[kind, b])}
                       for b, n in enumerate(self.nodes[kind]) if n]
                for kind, name in enumerate(KIND_NAMES)}
