"""Draft tree: the flattened token tree one request proposes for one step.

The *root* is the last committed token (already in the context, not part of
the tree). Nodes ``0..k-1`` are draft tokens in DFS order with children sorted
by weight, so every parent precedes its children and any prefix of the node
list is itself a valid tree (the scheduler may truncate a draft to a prefix).

Worked example (seed 000 Fig. 2c): root ``sits`` and branches
``[on, my, knee]``, ``[on, a, table]``, ``[on, a, chair]`` merge into::

    index   0   1   2     3  4      5
    token   on  a   table chair my  knee     (if "a" outweighs "my")
    parent  -1  0   1     1  0      4
    depth   1   2   3     3  2      3

Node ``i`` sits at position ``root_position + depth[i]`` and attends to the
committed context, the root, and exactly its ancestors and itself
(``ancestor_mask[i]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class DraftTree:
    # Draft token ids, DFS order (parent before child).
    tokens: tuple[int, ...]
    # Parent index of each node; -1 means the root (the last committed token).
    parents: tuple[int, ...]
    # Ranking weight of each node (higher = more likely): a chain cut from the tree follows the heaviest child.
    weights: tuple[float, ...]
    # Estimated probability that the whole root-to-node path is accepted
    # (product of smoothed P(child | parent)); empty means unknown (all 1.0).
    confidence: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.parents) == len(self.weights):
            raise ValueError("tokens, parents and weights must have equal length")
        if self.confidence and len(self.confidence) != len(self.tokens):
            raise ValueError("confidence must be empty or one value per node")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"parents[{i}]={p}: must be in [-1, {i - 1}] (parent first)")

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls((), (), ())

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...]) -> "DraftTree":
        n = len(tokens)
        return cls(tuple(tokens), tuple(range(-1, n - 1)), tuple(float(n - i) for i in range(n)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node; children of the root have depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)

    def ancestor_mask(self) -> np.ndarray:
        """``[k, k]`` bool: ``mask[i, j]`` iff node j is node i or its ancestor."""
        k = len(self.tokens)
        mask = np.zeros((k, k), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def children(self) -> list[list[int]]:
        """Child indices of every node, plus the root's children last (index -1)."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p].append(i)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def is_chain(self) -> bool:
        """Every node's parent is the node before it."""
        return self.parents == tuple(range(-1, len(self.parents) - 1))

    def node_confidence(self, i: int) -> float:
        return self.confidence[i] if self.confidence else 1.0

    def truncate(self, k: int) -> "DraftTree":
        """The first ``k`` nodes (still a valid tree because parents come first)."""
        return DraftTree(self.tokens[:k], self.parents[:k], self.weights[:k], self.confidence[:k])


def rows_of(count: int, width: int) -> tuple[np.ndarray, ...]:
    """Empty ``[count, width]`` draft rows, many requests' trees as arrays:
    tokens, parents (-1: the root), weights, confidence, and the lengths."""
    return (np.zeros((count, width), np.int32), np.full((count, width), -1, np.int32),
            np.zeros((count, width)), np.zeros((count, width)), np.zeros(count, np.int64))


def fill_row(rows: tuple[np.ndarray, ...], i: int, tree: DraftTree) -> None:
    """Write ``tree`` into row ``i`` of :func:`rows_of`'s arrays."""
    n = len(tree)
    tokens, parents, weights, conf, lengths = rows
    tokens[i, :n], parents[i, :n], weights[i, :n] = tree.tokens, tree.parents, tree.weights
    conf[i, :n] = [tree.node_confidence(j) for j in range(n)]
    lengths[i] = n
