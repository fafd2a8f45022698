"""Sharing one step's draft budget across the batch, by expected gain vs cost (docs/how-it-works.md, "Forward-cost
model"; the prices: docs/prices.md, fitted online by core/prices.py unless pinned). A node's confidence is the
estimated probability that it is accepted, so a step of ``R`` requests keeping nodes of total confidence ``S`` emits
``R + S`` tokens in ``cost(R + kept) + draft_setup`` forwards (:class:`ForwardCost`). The planner merges the
requests' nodes most-confident-first (each keeps a prefix of its draft order) and keeps the merged prefix with the
best ratio, capped at ``budget`` tokens, or nothing where none beats ``R / cost(R)``; a prefix also pays
``path_setup + per_path * rounds``, ``rounds`` the most paths (a parent's second or later child opens one) any one
request opens. Example: confidences ``[[0.9, 0.5, 0.2], [0.8, 0.7]]`` with budget 3 keep ``[0.9]`` + ``[0.8, 0.7]``.
Natively in ``plan_trees``; reference: ``lookahead_lab.reference.planner``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lookahead_vllm.core.config import Settings


@dataclass(frozen=True, slots=True)
class ForwardCost:
    """The forward-cost model, ``cost(T) = 1 + max(0, T - free_tokens) / marginal_tokens`` plus the prices below,
    every price in single-token forwards."""

    free_tokens: int  # tokens one forward scores at about the cost of one (0 = no cost model: drafts are free)
    marginal_tokens: float  # past ``free_tokens``, this many more tokens cost one more forward
    per_path: float = 0.0  # each root-to-leaf path tree attention runs apart (0 where one kernel launch runs all)
    path_setup: float = 0.0  # a step that runs any such path
    draft_setup: float = 0.0  # a step with any draft token over a draftless one (its first kept draft token pays it)
    per_row: float = 0.0  # every row past the first (per-sequence attention, sampling, bookkeeping)
    per_context: float = 0.0  # a row that carries any draft token, per thousand tokens of its context

    def at_rows(self, rows: int) -> "ForwardCost":
        """This model for a step of ``rows`` rows in units of its draftless base ``1 + per_row * (rows - 1)``,
        which drafts do not change: it ranks the step's drafts the same (throughputs are cost ratios)."""
        if not self.per_row or rows <= 1 or not self.free_tokens:
            return self
        base = 1.0 + self.per_row * (rows - 1)
        return ForwardCost(self.free_tokens, self.marginal_tokens * base, self.per_path / base,
                           self.path_setup / base, self.draft_setup / base, 0.0, self.per_context / base)

    def entry(self, context: np.ndarray) -> np.ndarray:
        """What each row at ``context`` tokens of context pays for any draft (its first kept node pays it)."""
        return np.asarray(context, np.float64) * (self.per_context / 1000.0)

    def __call__(self, tokens: int, paths: int = 0) -> float:
        """Forward time for ``tokens`` scored tokens and ``paths`` extra attention paths (one row, or a model
        :meth:`at_rows` made for the step). Scalar arithmetic: the replays call it per step (arrays cost ~20x)."""
        if self.free_tokens == 0:
            return 1.0
        extra = self.path_setup + paths * self.per_path if paths else 0.0
        return 1.0 + max(0, tokens - self.free_tokens) / self.marginal_tokens + extra

    def many(self, tokens: np.ndarray, paths: np.ndarray) -> np.ndarray:
        """:meth:`__call__` for every ``tokens[i]``, ``paths[i]`` (the same values, bit for bit)."""
        tokens, paths = np.asarray(tokens, np.int64), np.asarray(paths, np.int64)
        if self.free_tokens == 0:
            return np.ones(tokens.shape)
        extra = np.where(paths != 0, self.path_setup + paths * self.per_path, 0.0)
        return 1.0 + np.maximum(0, tokens - self.free_tokens) / self.marginal_tokens + extra

    def drafted(self, tokens: int, paths: int = 0) -> float:
        """:meth:`__call__` for a step that carries draft tokens (plus :attr:`draft_setup`)."""
        return self(tokens, paths) + self.draft_setup

    def draft_pays(self, rows: int) -> bool:
        """Whether any draft can raise the expected throughput of a step of ``rows`` one-token rows: not past the
        free tokens with ``marginal_tokens <= free_tokens``, where ``t / cost(t)`` no longer grows."""
        return not self.free_tokens or rows < self.free_tokens or self.marginal_tokens > self.free_tokens


def forward_cost(config: "Settings", paths: bool = True) -> ForwardCost:
    """The cost model of ``config``: token prices pinned by the public fields (>= 0) or the profile's prior; its
    path prices where drafts may open extra attention paths (``paths``: tree mode)."""
    p = config.profile
    free = p.free_tokens if config.cost_free_tokens < 0 else config.cost_free_tokens
    marginal = p.marginal_tokens if config.cost_marginal_tokens < 0 else config.cost_marginal_tokens
    return ForwardCost(free, marginal, p.cost_per_path if paths else 0.0, p.path_setup if paths else 0.0,
                       p.draft_setup, p.row_price, p.context_price)


def prices_pinned(config: "Settings") -> bool:
    """Whether ``config`` pins the token prices (a ``cost_*`` field >= 0; ``cost_free_tokens=0``: model off), so
    the engine fits none (core/prices.py)."""
    return config.cost_free_tokens >= 0 or config.cost_marginal_tokens >= 0


MAX_CONFIDENCE_FLOOR = 0.5  # the batch-scaled floor's cap: large batches still draft their surest continuations


def confidence_floor(config: "Settings", drafting: int) -> float:
    """Path confidence below which a step's drafts are cut: ``min_draft_confidence`` while the cost model prices
    every node against the load; with the model off, times the rows drafting, at most :data:`MAX_CONFIDENCE_FLOOR`."""
    floor = config.profile.min_draft_confidence
    return floor if config.cost_free_tokens != 0 else min(MAX_CONFIDENCE_FLOOR, floor * drafting)
