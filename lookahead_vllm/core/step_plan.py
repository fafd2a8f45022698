"""Step plan: what one request asks the target model to score in one step.

The plan's *rows* are the root (the last committed token, row 0) followed by
the ``k`` draft nodes of a :class:`DraftTree` (row ``i + 1`` is node ``i``). Per
row it fixes:

- a position offset: the root's position plus the row's depth (root 0);
- a visibility row over the plan's rows: itself and its ancestors, root
  included (the committed context is always visible);
- a role: ``verify`` rows may be accepted (trie and pool branches); Jacobi
  ``lookahead`` rows (core/jacobi.py), after every verify row, are never
  accepted: their outputs only refill the window and the n-gram pool.

Acceptance walks the tree from the root: at each reached row the target's token
(argmax, or a sample) is accepted if a child of that row carries it, and the
walk moves there; otherwise it stops and that token is the *bonus*. Worked
example with nodes ``0:a(root) 1:b(0) 2:c(root)`` and target tokens per row
``[c, x, y, z]``: row 0 yields ``c`` -> node 2 accepted; row 3 (node 2) yields
``z``, node 2 has no child -> output ``[c, z]``, accepted nodes ``[2]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from lookahead_vllm.core.draft_tree import DraftTree

ROLE_VERIFY = "verify"
ROLE_LOOKAHEAD = "lookahead"


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One request's rows for one step (root + draft nodes)."""

    tree: DraftTree
    # Per node: True for a Jacobi lookahead node (empty: all verify).
    lookahead: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if self.lookahead and len(self.lookahead) != len(self.tree):
            raise ValueError(f"lookahead flags: {len(self.lookahead)} for {len(self.tree)} nodes")
        if self.lookahead and not all(self.lookahead[self.verify_nodes:]):
            raise ValueError(f"lookahead flags {self.lookahead}: the lookahead nodes must follow every verify node")

    def role(self, node: int) -> str:
        return ROLE_LOOKAHEAD if self.lookahead and self.lookahead[node] else ROLE_VERIFY

    @property
    def has_lookahead(self) -> bool:
        return any(self.lookahead)

    @property
    def num_nodes(self) -> int:
        return len(self.tree)

    @property
    def verify_nodes(self) -> int:
        """The nodes that may be accepted: all but the lookahead nodes, which come last."""
        return self.lookahead.index(True) if any(self.lookahead) else len(self.tree)

    def is_chain(self) -> bool:
        """True if every node's parent is the previous node (plain causal rows)
        and every node may be accepted (vLLM's chain verification applies)."""
        return not self.has_lookahead and self.tree.is_chain()

    def chain_prefix_length(self) -> int:
        """Number of leading nodes that form a chain from the root."""
        for i, p in enumerate(self.tree.parents):
            if p != i - 1:
                return i
        return len(self.tree)

    def position_offsets(self) -> np.ndarray:
        """``[1 + k]`` int64: 0 for the root, the depth for every node."""
        return np.asarray((0, *self.tree.depths), dtype=np.int64)

    def visibility(self) -> np.ndarray:
        """``[1 + k, 1 + k]`` bool: row ``i`` sees row ``j`` (root and ancestors, itself)."""
        k = len(self.tree)
        vis = np.zeros((k + 1, k + 1), dtype=bool)
        vis[:, 0] = True
        vis[1:, 1:] = self.tree.ancestor_mask()
        return vis

    def truncate(self, k: int) -> "StepPlan":
        """The first ``k`` nodes (this plan where it has no more)."""
        return self if k >= len(self.tree) else StepPlan(self.tree.truncate(k), self.lookahead[:k])


def walk_tree(plan: StepPlan, target_at: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Accept along the tree; ``target_at(row)`` gives the target's token at a row.

    Returns ``(accepted_nodes, output_tokens)``: the accepted node indices in
    root-to-leaf order and the tokens to emit (the accepted nodes' tokens, then
    the bonus). ``target_at`` is called once per reached row, in walk order, so
    a sampler may draw lazily. Lookahead nodes are never accepted.
    """
    kids = plan.tree.children()
    if plan.has_lookahead:
        kids = [[c for c in cs if not plan.lookahead[c]] for cs in kids]
    tokens = plan.tree.tokens
    accepted: list[int] = []
    node = -1
    while True:
        target = target_at(node + 1)
        child = next((c for c in kids[node] if tokens[c] == target), None)
        if child is None:
            return accepted, [tokens[i] for i in accepted] + [target]
        accepted.append(child)
        node = child


def accepted_path(tree: DraftTree, emitted: Sequence[int]) -> list[int]:
    """Nodes of ``tree`` a step accepted, given what it emitted for the request
    (the accepted tokens, then the bonus): the walk with the emitted tokens as
    the targets (children carry distinct tokens, so the path is unique)."""
    targets = iter(emitted)
    nodes, _ = walk_tree(StepPlan(tree), lambda _row: next(targets, -1))
    return nodes
