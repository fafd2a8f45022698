"""One request's tree as Python objects: the test oracles of the product's rows of arrays.

The product keeps every step's trees as rows of arrays (``core/tree_plan.py``:
``TreeOffers``, ``TreeBatch``, ``StepDrafts``); the references and tests read
them through the objects here.

**DraftTree**: the flattened token tree one request proposes for one step.

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

**StepPlan**: what one request asks the target model to score in one step.

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
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from lookahead_vllm.core.drafter import INDEX_WEIGHT
from lookahead_vllm.core.tree_plan import StepDrafts, TreeBatch, TreeOffers

if TYPE_CHECKING:
    from lookahead_vllm.vllm.tree_verify import TreeResults


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


def fill_row(rows: tuple[np.ndarray, ...], i: int, tree: DraftTree) -> None:
    """Write ``tree`` into row ``i`` of :func:`~lookahead_vllm.core.drafter.rows_of`'s arrays."""
    n = len(tree)
    tokens, parents, weights, conf, lengths = rows
    tokens[i, :n], parents[i, :n], weights[i, :n] = tree.tokens, tree.parents, tree.weights
    conf[i, :n] = [tree.node_confidence(j) for j in range(n)]
    lengths[i] = n


def index_tree(tokens: np.ndarray, parents: np.ndarray, conf: np.ndarray) -> DraftTree:
    """A draft index row as a :class:`DraftTree` (weights as the drafter ranks index nodes)."""
    confs = tuple(np.asarray(conf, np.float64).tolist())
    return DraftTree(tuple(np.asarray(tokens).tolist()), tuple(np.asarray(parents).tolist()),
                     tuple([INDEX_WEIGHT * c for c in confs]), confs)


def offer_tree(offers: TreeOffers, d: int) -> DraftTree:
    """Offer ``d`` as handed out."""
    n = int(offers.lengths[d])
    return index_tree(offers.tokens[d, :n], offers.parents[d, :n], offers.raw[d, :n])


def batch_of_plans(plans: Sequence[StepPlan]) -> TreeBatch:
    """:class:`StepPlan` objects as one :class:`TreeBatch`."""
    lengths = np.fromiter((p.num_nodes for p in plans), np.int64, len(plans))
    width = max(1, int(lengths.max(initial=0)))
    tokens, parents = np.zeros((len(plans), width), np.int32), np.full((len(plans), width), -1, np.int32)
    for t, p in enumerate(plans):
        tokens[t, :p.num_nodes], parents[t, :p.num_nodes] = p.tree.tokens, p.tree.parents
    verify = np.fromiter((p.verify_nodes for p in plans), np.int64, len(plans))
    return TreeBatch(tokens, parents, lengths, verify)


def batch_plan(trees: TreeBatch, t: int) -> StepPlan:
    """Row ``t`` of a :class:`TreeBatch` as a :class:`StepPlan` (weights 1, no confidences)."""
    n, v = int(trees.lengths[t]), int(trees.verify[t])
    tree = DraftTree(tuple(trees.tokens[t, :n].tolist()), tuple(trees.parents[t, :n].tolist()), (1.0,) * n)
    return StepPlan(tree, (False,) * v + (True,) * (n - v) if v < n else ())


def step_plan(drafts: StepDrafts, req_id: str) -> StepPlan | None:
    """The request's whole plan in a step's :class:`StepDrafts` (None: it verifies a chain, or
    drafted nothing): ``batch``'s row, with the offer's weights and confidences (the window's
    nodes 0)."""
    d = drafts.rows.get(req_id)
    if d is None:
        return None
    trees, _ = drafts.batch([req_id], np.array([np.iinfo(np.int64).max]))
    row = batch_plan(trees, 0)
    offer = offer_tree(drafts.offers, d)
    zeros = (0.0,) * (row.num_nodes - len(offer))
    return StepPlan(DraftTree(row.tree.tokens, row.tree.parents, offer.weights + zeros, offer.confidence + zeros),
                    row.lookahead)


def step_plans(drafts: StepDrafts) -> dict[str, StepPlan]:
    """Every request's plan in a step's :class:`StepDrafts`."""
    return {req_id: step_plan(drafts, req_id) for req_id in drafts.rows}


def tree_results(entries: Sequence[tuple[str, int, list[int], list[int] | None]]) -> TreeResults:
    """A step's :class:`~lookahead_vllm.vllm.tree_verify.TreeResults` from one
    ``(req_id, num_nodes, accepted nodes, window tokens or None)`` a tree."""
    accepted = np.fromiter((len(e[2]) for e in entries), np.int64, len(entries))
    nodes = np.array([n for e in entries for n in e[2]], np.int64)
    windows = {t: list(e[3]) for t, e in enumerate(entries) if e[3] is not None}
    from lookahead_vllm.vllm.tree_verify import TreeResults

    return TreeResults([e[0] for e in entries], np.array([e[1] for e in entries], np.int64), accepted, nodes, windows)


def tree_result_rows(results: TreeResults) -> list[tuple[str, int, list[int], list[int] | None]]:
    """:func:`tree_results`'s entries back from a step's results."""
    return [(r, int(n), nodes.tolist(), results.windows.get(t))
            for t, (r, n, nodes) in enumerate(zip(results.req_ids, results.num_nodes, results.accepted_nodes()))]
