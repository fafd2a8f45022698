"""Pure-Python references of the extension's planner kernels
(``csrc/draft_index/trees.cpp``, ``token_trie.cpp``): ``merge_rows``,
``plan_trees``, ``match_trees``, ``observe_trees`` and ``walk_trees``, with the extension's
array signatures, built from :class:`DraftTree`, the calibration rule and the
step allocator core/budget.py defines. Tests hold the native kernels to these,
confidences bit for bit. The Jacobi table's reference, with the oracles of its pool rows
and of a window row's ``StepDrafts.plan``, is ``lookahead_lab.reference.jacobi``.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Iterator, Sequence

import numpy as np

from lookahead_vllm.core.budget import ForwardCost
from lookahead_vllm.core.calibration import BIN_EDGES, KIND_BRANCH, KIND_CHAIN, KIND_CONTEXT, KIND_POOL
from lookahead_vllm.core.drafter import rows_of
from lookahead_lab.reference.trees import DraftTree, StepPlan, accepted_path, fill_row, index_tree, walk_tree


def row_tree(rows: tuple[np.ndarray, ...], i: int) -> DraftTree:
    """Row ``i`` of draft rows (``core.drafter.rows_of``) as a :class:`DraftTree`."""
    tokens, parents, weights, conf, lengths = rows
    n = int(lengths[i])
    return DraftTree(tuple(tokens[i, :n].tolist()), tuple(parents[i, :n].tolist()), tuple(weights[i, :n].tolist()),
                     tuple(conf[i, :n].tolist()))


# --------------------------------------------------------------- step allocation
def _merged_order(confidences: Sequence[Sequence[float]]) -> list[tuple[float, int]]:
    """(confidence, request) in the order nodes are kept: always the most
    confident next node among the requests' draft-order heads."""
    heap = [(-confs[0], req, 0) for req, confs in enumerate(confidences) if confs]
    heapq.heapify(heap)
    order = []
    while heap:
        neg, req, pos = heapq.heappop(heap)
        order.append((-neg, req))
        if pos + 1 < len(confidences[req]):
            heapq.heappush(heap, (-confidences[req][pos + 1], req, pos + 1))
    return order


def allocate_step_budget(
    confidences: Sequence[Sequence[float]],
    budget: int | None = None,
    num_rows: int | None = None,
    cost: ForwardCost | None = None,
    new_paths: Sequence[Sequence[bool]] | None = None,
    entry: Sequence[float] | None = None,
) -> list[int]:
    """Prefix length to keep per request: at most ``budget`` tokens in all
    (None = no cap), and, given ``cost``, the count that maximises expected
    tokens per forward for ``num_rows`` requests (default: one per confidence
    list). ``new_paths[r][i]``: whether request ``r``'s node ``i`` opens a path
    (:func:`opens_path`). ``entry[r]``: what request ``r`` pays once it keeps any
    node (:meth:`ForwardCost.entry`); a request whose whole draft would not win
    back its entry at the step's rate keeps nothing, judged at the draftless
    rate, then at the rate that plan reached (the better plan stands)."""
    rows = len(confidences) if num_rows is None else num_rows
    if cost is None or not cost.free_tokens or entry is None:
        return _best_prefix(confidences, budget, rows, cost, new_paths, None)[1]

    def paid(rate: float) -> list[bool]:
        return [e <= 0 or sum(c) > e * rate for c, e in zip(confidences, entry)]

    def rows_of(mask: list[bool]) -> list[Sequence[float]]:
        return [c if ok else [] for c, ok in zip(confidences, mask)]

    first = paid(rows / cost(rows))
    rate, keep = _best_prefix(rows_of(first), budget, rows, cost, new_paths, entry)
    second = paid(rate)
    if second != first:
        other_rate, other = _best_prefix(rows_of(second), budget, rows, cost, new_paths, entry)
        if other_rate > rate:
            keep = other
    return keep


def _best_prefix(confidences: Sequence[Sequence[float]], budget: int | None, rows: int, cost: ForwardCost | None,
                 new_paths: Sequence[Sequence[bool]] | None, entry: Sequence[float] | None) -> tuple[float, list[int]]:
    """:func:`allocate_step_budget` over the rows as given: the best rate
    (the draftless one when nothing pays; 0 without a cost model) and the
    prefix each row keeps."""
    order = _merged_order(confidences)
    limit = len(order) if budget is None else min(budget, len(order))
    take, best = limit, 0.0
    if cost is not None and cost.free_tokens:
        best, gained, fees = rows / cost(rows), 0.0, 0.0
        take, kept, paths, rounds = 0, [0] * len(confidences), [0] * len(confidences), 0
        for m, (conf, req) in enumerate(order[:limit], start=1):
            gained += conf
            if new_paths is not None and new_paths[req][kept[req]]:
                paths[req] += 1
                rounds = max(rounds, paths[req])
            if entry is not None and not kept[req]:
                fees += entry[req]
            kept[req] += 1
            rate = (rows + gained) / (cost.drafted(rows + m, rounds) + fees)
            if rate > best:
                best, take = rate, m
    keep = [0] * len(confidences)
    for _, req in order[:take]:
        keep[req] += 1
    return best, keep


def opens_path(parents: Sequence[int]) -> list[bool]:
    """Per node of a parent-first (DFS) tree: whether it starts a root-to-leaf
    path of its own, i.e. is not its parent's first child (``parents[i]`` is
    ``-1`` for the root's children; the root's first child continues the root)."""
    return [p + 1 != i for i, p in enumerate(parents)]


# --------------------------------------------------------------- tree algebra
def best_path(tree: DraftTree) -> list[int]:
    """Node indices of the path that follows the heaviest child from the root."""
    kids = tree.children()
    path: list[int] = []
    node = -1
    while kids[node]:
        node = max(kids[node], key=lambda c: tree.weights[c])
        path.append(node)
    return path


def best_chain(tree: DraftTree) -> list[int]:
    """Tokens of :func:`best_path`."""
    return [tree.tokens[i] for i in best_path(tree)]


def best_path_tree(tree: DraftTree) -> DraftTree:
    """:func:`best_path` as a chain tree, its nodes' weights and confidences kept."""
    path = best_path(tree)
    return DraftTree(
        tuple(tree.tokens[i] for i in path), tuple(range(-1, len(path) - 1)),
        tuple(tree.weights[i] for i in path), tuple(tree.node_confidence(i) for i in path) if path else (),
    )


def merged(tree: DraftTree, other: DraftTree, budget: int) -> DraftTree:
    """``tree`` plus ``other``'s nodes (same root), shared prefixes merged, at
    most ``budget`` nodes: ``tree``'s nodes keep their order and values;
    ``other``'s new nodes follow, parents first, with their confidence as
    weight, so they rank below ``tree``'s nodes (whose weights are counts
    >= 1) in :func:`best_path`. A new node's confidence is at most its
    parent's in the merged tree (a path is accepted no more often than its
    prefix, whichever source drafted each part)."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    weights = list(tree.weights)
    confs = [tree.node_confidence(i) for i in range(len(tree))]
    index = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    mapped: dict[int, int] = {-1: -1}
    for j, (token, parent) in enumerate(zip(other.tokens, other.parents)):
        if parent not in mapped:
            continue  # its parent did not fit
        key = (mapped[parent], token)
        if key not in index:
            if len(tokens) >= budget:
                continue
            conf = other.node_confidence(j) if key[0] < 0 else min(other.node_confidence(j), confs[key[0]])
            index[key] = len(tokens)
            tokens.append(token)
            parents.append(key[0])
            weights.append(conf)
            confs.append(conf)
        mapped[j] = index[key]
    return DraftTree(tuple(tokens), tuple(parents), tuple(weights), tuple(confs))


# --------------------------------------------------------------- node kinds
def node_kinds(tree: DraftTree, pool_from: int | None = None, context: int = 0) -> list[int]:
    """Per node: KIND_CONTEXT for the first ``context`` nodes (the context
    chain), KIND_POOL from ``pool_from`` on (Jacobi pool n-grams merged after
    the trie's nodes), else KIND_CHAIN on the leading chain (node ``i``'s
    parent is ``i - 1`` from the root on) and KIND_BRANCH off it."""
    pool_from = len(tree) if pool_from is None else pool_from
    kinds, chain = [], True
    for i, p in enumerate(tree.parents):
        chain = chain and p == i - 1
        kind = KIND_CHAIN if chain else KIND_BRANCH
        kinds.append(KIND_CONTEXT if i < context else KIND_POOL if i >= pool_from else kind)
    return kinds


def index_kinds(tree: DraftTree, n_index: int, pool_from: int | None = None) -> list[int]:
    """Index nodes are KIND_CONTEXT on the leading chain and KIND_BRANCH off
    it; nodes merged after them (trie, and the Jacobi pool's from
    ``pool_from`` on) follow :func:`node_kinds`."""
    kinds = node_kinds(tree, pool_from)
    chain = True
    for i in range(n_index):
        chain = chain and tree.parents[i] == i - 1
        kinds[i] = KIND_CONTEXT if chain else KIND_BRANCH
    return kinds


# --------------------------------------------------------------- calibration
def calibrate(tree: DraftTree, kinds: Sequence[int], factors: np.ndarray) -> list[float]:
    """Calibrated confidence of every node of ``tree`` (parents first) under
    the correction ``factors [kinds, bins]``; never grows along a path."""
    out: list[float] = []
    for i, (p, kind) in enumerate(zip(tree.parents, kinds)):
        raw = tree.node_confidence(i)
        c = min(1.0, raw * factors[kind, bisect.bisect_left(BIN_EDGES, raw)])
        out.append(c if p < 0 else min(c, out[p]))
    return out


def observe_nodes(predicted: np.ndarray, accepted: np.ndarray, nodes: np.ndarray, factor: np.ndarray,
                  kinds: np.ndarray, raw: np.ndarray, hits: np.ndarray, prior: float, half_life: float) -> None:
    """Book verified nodes (kinds, raw confidences, whether accepted) into the
    calibrator's tables, in place: totals per (kind, bin), halved once a bin
    has seen ``half_life`` nodes, then the bins' factors
    ``(accepted + prior) / (predicted + prior)``."""
    if not len(kinds):
        return
    width = nodes.shape[1]
    cell = np.asarray(kinds, np.int64) * width + np.searchsorted(BIN_EDGES, raw, side="left")
    size = nodes.size
    predicted += np.bincount(cell, raw, size).reshape(predicted.shape)
    accepted += np.bincount(cell, hits, size).reshape(accepted.shape)
    nodes += np.bincount(cell, None, size).reshape(nodes.shape)
    k, b = np.divmod(np.unique(cell), width)
    full = nodes[k, b] >= half_life
    for arr in (predicted, accepted, nodes):
        arr[k[full], b[full]] /= 2
    factor[k, b] = (accepted[k, b] + prior) / (predicted[k, b] + prior)


def observe_trees(predicted, accepted, nodes, factor, bin_edges, raw, kinds, hits, at, verified, prior, half_life
                  ) -> None:
    """The extension's ``observe_trees``: row ``at[i]`` of ``raw``/``kinds``/
    ``hits [D, W]`` had its first ``verified[i]`` nodes verified, in order."""
    assert tuple(bin_edges) == BIN_EDGES
    mask = np.arange(raw.shape[1]) < np.asarray(verified)[:, None]
    observe_nodes(predicted, accepted, nodes, factor, kinds[at][mask].astype(np.int64), raw[at][mask],
                  hits[at][mask].astype(bool), prior, half_life)


# --------------------------------------------------------------- merging
def merge_rows(lead, lead_context, trie, budgets, cut, pool=None) -> tuple[np.ndarray, ...]:
    """The extension's ``merge_rows`` (``Drafter.draft``): row ``i``'s lead
    (an index tree, or where ``lead_context[i]`` the context chain) first,
    the trie's tree merged after it, the pool's after those, cut to its best
    path where ``cut[i]``; with every node's calibration kind."""
    count = len(budgets)
    pool = rows_of(count, 1) if pool is None else pool
    width = max([1, *map(int, budgets), *map(int, lead[4]), *map(int, trie[4]), *map(int, pool[4])])
    out, kinds = rows_of(count, width), np.zeros((count, width), np.int8)
    for r in range(count):
        a, b, c = row_tree(lead, r), row_tree(trie, r), row_tree(pool, r)
        t = merged(a, b, int(budgets[r])) if len(a) and len(b) else a if len(a) else b
        pool_from = len(t)
        t = merged(t, c, int(budgets[r])) if len(c) else t
        k = (node_kinds(t, pool_from, len(a)) if lead_context[r] else index_kinds(t, len(a), pool_from)) if len(a) \
            else node_kinds(t, pool_from)
        if cut is not None and cut[r] and not t.is_chain():
            k, t = [k[i] for i in best_path(t)], best_path_tree(t)
        fill_row(out, r, t)
        kinds[r, :len(t)] = k
    return (*out[:4], kinds, out[4])


# --------------------------------------------------------------- booking
def verified_offers(offer_slots: np.ndarray, offer_lengths: np.ndarray, slots: np.ndarray, scheduled: np.ndarray
                    ) -> Iterator[tuple[int, int, int]]:
    """Per row that verified part of last step's offer, in row order: the
    row, the offer's index and the nodes verified (at most the offer's length)."""
    where = {s: d for d, (s, n) in enumerate(zip(offer_slots.tolist(), offer_lengths.tolist())) if n > 0}
    for i, (slot, sched) in enumerate(zip(np.asarray(slots).tolist(), np.asarray(scheduled).tolist())):
        d = where.get(slot)
        if d is not None and sched > 0:
            yield i, d, min(sched, int(offer_lengths[d]))


def match_trees(offer_slots, offer_lengths, tokens, parents, slots, scheduled, emitted
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The extension's ``match_trees`` (``TreeOffers.match``): per row that
    verified part of its offer, the offer's index and the nodes verified;
    ``hits [D, W]``: the verified nodes accepted."""
    at, verified = [], []
    hits = np.zeros(tokens.shape, np.uint8)
    for i, d, v in verified_offers(offer_slots, offer_lengths, slots, scheduled):
        n = int(offer_lengths[d])
        tree = index_tree(tokens[d, :n], parents[d, :n], np.zeros(n))
        at.append(d)
        verified.append(v)
        hits[d, accepted_path(tree.truncate(v), emitted[i])] = 1
    return np.asarray(at, np.int64), np.asarray(verified, np.int64), hits


def walk_trees(tokens, parents, lens, targets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The extension's ``walk_trees`` (``tree_verify``'s greedy walks), tree by tree with
    :func:`~lookahead_lab.reference.trees.walk_tree`: tree ``d``'s first ``lens[d]`` nodes,
    the target at row ``r`` (0: the root, ``1 + c``: node ``c``) ``targets[d, r]``. Returns the
    accepted nodes ``[D, W]`` (-1 after them), their counts and the bonus tokens."""
    trees, width = tokens.shape
    nodes, counts, bonus = np.full((trees, width), -1, np.int32), np.zeros(trees, np.int64), np.zeros(trees, np.int64)
    for d in range(trees):
        n = int(lens[d])
        tree = DraftTree(tuple(int(t) for t in tokens[d, :n]), tuple(int(p) for p in parents[d, :n]), (1.0,) * n)
        path, out = walk_tree(StepPlan(tree), lambda row: int(targets[d, row]))
        nodes[d, :len(path)], counts[d], bonus[d] = path, len(path), out[-1]
    return nodes, counts, bonus


# --------------------------------------------------------------- planning
def plan_trees(tokens, parents, raw, lengths, tree_ok, bin_edges, factors, budget, num_rows, free_tokens,
               marginal_tokens, per_path, path_setup, draft_setup, out_rows, num_out, given=None, entry=None):
    """The extension's ``plan_trees`` (core/tree_plan.py), request by
    request: each row's tree (cut to its best path where it may not verify
    one, unless ``given`` kinds say it is already cut), calibrated, then the
    batch's best prefix (``allocate_step_budget``). Returns tokens, parents,
    raw confidences, kinds, nodes kept per row, calibrated confidences,
    whether each kept draft is a tree, and the ``num_out`` batch rows' drafts."""
    assert tuple(bin_edges) == BIN_EDGES
    cost = ForwardCost(free_tokens, marginal_tokens, per_path, path_setup, draft_setup)
    rows, width = raw.shape
    offers, confs, opens = [], [], []
    for r in range(rows):
        n = int(lengths[r])
        tree = index_tree(tokens[r, :n], parents[r, :n], raw[r, :n])
        kinds = index_kinds(tree, n) if given is None else given[r, :n].tolist()
        if given is None and not tree_ok[r] and not tree.is_chain():
            kinds = [kinds[i] for i in best_path(tree)]
            tree = best_path_tree(tree)
        offers.append((tree, kinds))
        confs.append(calibrate(tree, kinds, factors))
        opens.append(opens_path(tree.parents) if tree_ok[r] else [False] * len(tree))
    keep = allocate_step_budget(confs, None if budget < 0 else budget, num_rows, cost, opens,
                                None if entry is None else entry.tolist())
    out_tok, out_par = np.zeros((rows, width), np.int32), np.full((rows, width), -1, np.int32)
    out_raw, calibrated = np.zeros((rows, width)), np.zeros((rows, width))
    out_kinds, trees = np.zeros((rows, width), np.int8), np.zeros(rows, bool)
    drafts: list[list[int]] = [[] for _ in range(num_out)]
    for r, ((tree, kinds), c, n) in enumerate(zip(offers, confs, keep)):
        m = len(tree)
        out_tok[r, :m], out_par[r, :m], out_kinds[r, :m] = tree.tokens, tree.parents, kinds
        out_raw[r, :m] = [tree.node_confidence(i) for i in range(m)]
        calibrated[r, :m] = c
        kept = tree.truncate(n)
        trees[r] = bool(tree_ok[r]) and n > 0 and not kept.is_chain()
        drafts[int(out_rows[r])] = list(kept.tokens)
    return out_tok, out_par, out_raw, out_kinds, np.asarray(keep, np.int64), calibrated, trees, drafts
