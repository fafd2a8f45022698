"""Pure-Python references of the native trie (``csrc/draft_index/token_trie.h``)
and of a request's context chain, the oracles tests hold the native core to.

``TokenTrie``: the global n-gram trie described in lookahead_vllm/core/trie.py
(counts, multi-stage retrieval, pruning), one object per node.
``ContextIndex``: one request's context chain: what followed the latest
earlier occurrence of its trailing ``min_match`` tokens (the native trie keeps
one per request record); worked example: with ``min_match=2`` the tokens
``a b c d x a b`` end with ``a b``, which occurred at 0..1 followed by
``c d x a b``: the chain is ``c d x a`` for a budget of 4.
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from lookahead_vllm.core.config import Settings
from lookahead_vllm.core.drafter import rows_of
from lookahead_vllm.core.trie import NativeTrie, make_trie
from lookahead_lab.reference.trees import DraftTree, fill_row
from lookahead_lab.reference.planner import merged

logger = logging.getLogger(__name__)

# Earlier occurrences of the trailing n-gram kept per n-gram (most recent).
RECENT_OCCURRENCES = 8
# A backward match is extended at most this far (tokens) to rank occurrences.
MAX_MATCH = 32
# Ranking weight of chain nodes: above any trie count, so a chain-mode draft
# (the tree's best path) follows the context chain.
CONTEXT_WEIGHT = 1e18


class ContextIndex:
    """One request's tokens and, per ``min_match``-gram, where its most recent
    occurrences were followed by more tokens."""

    def __init__(self, min_match: int, tokens: Sequence[int] = ()) -> None:
        if min_match < 1:
            raise ValueError(f"min_match={min_match!r}: must be >= 1")
        self.min_match = min_match
        self.tokens: list[int] = []
        # n-gram -> positions of the token that followed it (ascending, at most RECENT_OCCURRENCES).
        self._next: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; index every n-gram that now has a follower."""
        n, seq = self.min_match, self.tokens
        start = max(n, len(seq))  # first follower position not indexed yet
        seq.extend(int(t) for t in tokens)
        for p in range(start, len(seq)):
            follows = self._next.setdefault(tuple(seq[p - n:p]), [])
            follows.append(p)
            if len(follows) > RECENT_OCCURRENCES:
                del follows[0]

    def match(self) -> tuple[int, int]:
        """(position where the continuation starts, match length), or (-1, 0)."""
        n, seq = self.min_match, self.tokens
        end = len(seq)
        if end <= n:
            return -1, 0
        best, best_len = -1, 0
        for p in reversed(self._next.get(tuple(seq[end - n:]), ())):
            length = n
            while length < MAX_MATCH and p - length - 1 >= 0 and seq[p - length - 1] == seq[end - length - 1]:
                length += 1
            if length > best_len:
                best, best_len = p, length
        return best, best_len

    def draft(self, budget: int, floor: float = 0.0) -> DraftTree:
        """The context chain (at most ``budget`` nodes, confidence >= ``floor``)."""
        start, length = self.match()
        if start < 0 or budget <= 0:
            return DraftTree.empty()
        tokens = self.tokens[start:start + budget]
        period = len(self.tokens) - start
        while len(tokens) < budget:  # the continuation reached the end: it repeats with the period
            tokens.append(tokens[len(tokens) - period])
        rate = match_confidence(length)
        confs = [rate ** d for d in range(1, len(tokens) + 1)]
        keep = sum(1 for c in confs if c >= floor)
        return DraftTree(
            tuple(tokens[:keep]), tuple(range(-1, keep - 1)), (CONTEXT_WEIGHT,) * keep, tuple(confs[:keep])
        )


def match_confidence(length: int) -> float:
    """Per-token raw confidence of a context chain whose match is ``length``
    tokens long: ``length / (length + 1)``."""
    return length / (length + 1)


# After pruning, the trie holds at most this fraction of its capacity.
PRUNE_TARGET = 0.75
# Rough CPython bytes per node (object + children dict); for reporting only.
BYTES_PER_NODE = 232


class _Node:
    __slots__ = ("token", "parent", "children", "out", "prompt", "ptotal", "alive", "serial")

    def __init__(self, token: int, parent: "_Node | None", serial: int = 0) -> None:
        self.token = token
        self.serial = serial  # creation order: deterministic tie-break when pruning
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.out = 0.0  # output count
        self.prompt: dict[int, int] | None = None  # request slot -> prompt count
        self.ptotal = 0  # sum of prompt counts
        self.alive = True

    def weight(self, slot: int, prompt_weight: float) -> float:
        own = self.prompt.get(slot, 0) if self.prompt else 0
        return prompt_weight * own + (self.ptotal - own) + self.out


@dataclass(eq=False, slots=True)
class TrieRecord:
    """One request's place in the trie (:meth:`TokenTrie.add_request`): held
    by the caller's record of the request, handed back to extend, retrieve
    and finish it; the trie keeps no table of requests."""

    # The trie's serial for the request: the key of its prompt counts.
    slot: int
    # node -> prompt count this request added there (for elimination).
    prompt_nodes: dict[_Node, int] = field(default_factory=dict)
    # Last (branch_length - 1) tokens of the sequence: the open output windows.
    window: list[int] = field(default_factory=list)
    # cursors[j] = node reached by the path window[j:].
    cursors: list[_Node] = field(default_factory=list)
    finished: bool = False
    # Its context chain (profile context_match; None where it is 0).
    context: ContextIndex | None = None


class TokenTrie:
    """Engine-wide n-gram trie; see the module docstring."""

    def __init__(self, config: Settings) -> None:
        self.config = config
        self.knobs = config.profile
        self.root = _Node(-1, None)
        self.num_nodes = 0  # root excluded
        self.num_prunes = 0
        self._serial = 0
        self._next_slot = 0

    # ------------------------------------------------------------------ admin
    @property
    def num_bytes(self) -> int:
        return self.num_nodes * BYTES_PER_NODE

    def add_request(self, prompt: Sequence[int]) -> TrieRecord:
        """Admit a request: insert its prompt windows and open its output
        windows; returns its record."""
        st = TrieRecord(slot=self._next_slot)
        self._next_slot += 1
        if self.knobs.insert_prompt:
            self._insert_prompt(st, prompt)
        if self.knobs.context_match:
            st.context = ContextIndex(self.knobs.context_match, prompt)
        tail = list(prompt[-(self.knobs.branch_length - 1):])
        st.window = tail
        st.cursors = [self._walk(tail[j:], create=True) for j in range(len(tail))]
        self._maybe_prune()
        return st

    def finish_request(self, st: TrieRecord) -> None:
        """Eliminate a finished or aborted request's prompt counts (idempotent)."""
        if st.finished:
            return
        st.finished = True
        for node, count in st.prompt_nodes.items():
            if node.prompt is not None and node.prompt.pop(st.slot, None) is not None:
                node.ptotal -= count
        for node in sorted(st.prompt_nodes, key=_depth, reverse=True):
            self._drop_if_empty(node)

    def extend(self, st: TrieRecord, tokens: Iterable[int], uncounted: int = 0) -> None:
        """Insert newly generated tokens of a request (on-the-fly output insertion); the first
        ``uncounted`` extend its windows without adding output counts (counted before a rewind)."""
        if st.finished:
            raise ValueError("extend: the request has finished")
        tokens = [int(t) for t in tokens]
        for i, t in enumerate(tokens):
            self._extend_one(st, t, 0.0 if i < uncounted else 1.0)
        if st.context is not None:
            st.context.extend(tokens)
        self._maybe_prune()

    def insert_output(self, tokens: Sequence[int]) -> None:
        """Insert a whole text as output counts (warm-up with past responses)."""
        st = TrieRecord(slot=-1)
        for t in tokens:
            self._extend_one(st, int(t))
        self._maybe_prune()

    # -------------------------------------------------------------- retrieval
    def retrieve(
        self,
        context: Sequence[int],
        budget: int | None = None,
        request: TrieRecord | None = None,
        shape: str | None = None,
        min_confidence: float | None = None,
    ) -> DraftTree:
        """Draft tree for the tokens that follow ``context`` (multi-stage matching).

        ``context`` ends with the root (the last committed token); the
        ``request``'s own prompt counts weigh ``prompt_weight``; at most
        ``budget`` nodes (default ``decoding_length``) are returned, none whose
        path confidence is below ``min_confidence`` (default
        ``min_draft_confidence``).
        """
        cfg = self.knobs
        budget = self.config.decoding_length if budget is None else budget
        shape = self.config.draft_shape if shape is None else shape
        floor = cfg.min_draft_confidence if min_confidence is None else min_confidence
        if budget <= 0 or not context:
            return DraftTree.empty()
        slot = request.slot if request is not None and not request.finished else -1
        best = DraftTree.empty()
        longest = min(cfg.max_match_length, len(context))
        for m in range(longest, cfg.min_match_length - 1, -1):
            node = self._walk(context[len(context) - m:], create=False)
            if node is None or not node.children:
                continue
            tree = self._select(node, budget, cfg.branch_length - m, shape, slot, floor)
            if shape == "one":
                best = tree if len(tree) > len(best) else best
                if len(tree) >= min(cfg.min_retrieved_nodes, budget):
                    break
            else:  # trees: shorter matches add branches below the longer ones' until full
                best = merged(best, tree, budget) if len(best) else tree
                if len(best) >= budget:
                    break
        return best

    def retrieve_rows(self, records: Sequence["TrieRecord | None"], contexts: np.ndarray, context_lens: np.ndarray,
                      budgets: Sequence[int], floor: float, shape: str | None = None) -> tuple[np.ndarray, ...]:
        """:meth:`retrieve` for many requests as ``[R, W]`` arrays (``W`` the
        largest budget, at least 1): request ``i`` drafts after
        ``contexts[i, :context_lens[i]]`` for ``records[i]`` (None: no
        record); ``tokens``, ``parents`` (-1: the root), ``weights``,
        ``confidence`` and ``lengths [R]``."""
        width = max([1, *map(int, budgets)])
        out = rows_of(len(records), width)
        span = self.knobs.max_match_length
        for i, record in enumerate(records):
            n = int(context_lens[i])
            tree = self.retrieve(contexts[i, max(0, n - span):n].tolist(), int(budgets[i]), record, shape, floor)
            fill_row(out, i, tree)
        return out

    def context_rows(self, records: Sequence[TrieRecord | None], budgets: Sequence[int], floor: float
                     ) -> tuple[np.ndarray, ...]:
        """Many requests' context chains (:class:`ContextIndex`) as draft
        rows (``[R, W]``, ``W`` the largest budget, at least 1); a record with
        none drafts nothing."""
        out = rows_of(len(records), max([1, *map(int, budgets)]))
        for i, record in enumerate(records):
            if record is not None and record.context is not None:
                fill_row(out, i, record.context.draft(int(budgets[i]), floor))
        return out

    def context_length(self, record: TrieRecord) -> int:
        """Tokens in the request's context chain (-1: it has none)."""
        return -1 if record.context is None else len(record.context)

    def extend_rows(self, records: Sequence[TrieRecord], token_ids: np.ndarray, rows: Sequence[int],
                    starts: Sequence[int], ends: Sequence[int]) -> None:
        """:meth:`extend` for many requests: ``records[i]`` gets
        ``token_ids[rows[i], starts[i]:ends[i]]``."""
        for record, row, start, end in zip(records, rows, starts, ends):
            self.extend(record, token_ids[int(row), int(start):int(end)].tolist())

    def _select(self, start: _Node, budget: int, max_depth: int, shape: str, slot: int, floor: float) -> DraftTree:
        if shape == "one":
            return self._select_chain(start, min(budget, max_depth), slot, floor)
        picked, confidence = self._best_first(start, budget, max_depth, slot, floor)
        if shape == "hier":
            return _flatten_dfs(start, picked, confidence)
        return _flatten_parallel(start, picked, confidence, budget)

    def _select_chain(self, node: _Node, depth: int, slot: int, floor: float) -> DraftTree:
        pw = self.knobs.prompt_weight
        tokens: list[int] = []
        weights: list[float] = []
        confs: list[float] = []
        confidence = 1.0
        while node.children and len(tokens) < depth:
            parent = node
            node = max(parent.children.values(), key=lambda c: (c.weight(slot, pw), -c.token))
            confidence *= _confidence(parent, node)
            if confidence <= 0 or confidence < floor:  # no evidence, or not enough
                break
            tokens.append(node.token)
            weights.append(node.weight(slot, pw))
            confs.append(confidence)
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)), tuple(weights), tuple(confs))

    def _best_first(
        self, start: _Node, budget: int, max_depth: int, slot: int, floor: float
    ) -> tuple[dict[_Node, float], dict[_Node, float]]:
        """Up to ``budget`` heaviest nodes below ``start`` forming a connected tree.

        Returns their weights and the path confidence of every visited node.
        """
        pw = self.knobs.prompt_weight
        picked: dict[_Node, float] = {}
        heap: list[tuple[float, int, int, _Node]] = []
        counter = 0
        confidence = {start: 1.0}

        def push(parent: _Node, depth: int) -> None:
            nonlocal counter
            if depth > max_depth:
                return
            children = parent.children.values()
            scale = confidence[parent] / (_children_total(parent) + 1.0)
            if len(children) > budget:  # at most `budget` of them can be picked
                children = heapq.nlargest(budget, children, key=lambda c: c.weight(slot, pw))
            for child in children:
                confidence[child] = scale * _raw_weight(child)
                if confidence[child] <= 0 or confidence[child] < floor:
                    continue
                counter += 1
                heapq.heappush(heap, (-child.weight(slot, pw), child.token, counter, child))

        push(start, 1)
        depth_of = {start: 0}
        while heap and len(picked) < budget:
            neg_w, _, _, node = heapq.heappop(heap)
            picked[node] = -neg_w
            depth_of[node] = depth_of[node.parent] + 1
            push(node, depth_of[node] + 1)
        return picked, confidence

    # ------------------------------------------------------------ snapshots
    def output_counts(self) -> tuple[list[int], list[int], list[float]]:
        """The output counts as a node table in pre-order (children in
        insertion order): ``parents`` (earlier rows, -1 = the root),
        ``tokens``, ``counts``. Subtrees holding no output count are left out
        (prompt counts belong to running requests)."""
        parents: list[int] = []
        tokens: list[int] = []
        counts: list[float] = []

        def visit(node: _Node, parent: int) -> bool:
            row = len(tokens)
            parents.append(parent)
            tokens.append(node.token)
            counts.append(node.out)
            kept = False
            for child in node.children.values():
                kept = visit(child, row) or kept
            if kept or node.out > 0:
                return True
            del parents[row:], tokens[row:], counts[row:]
            return False

        for child in self.root.children.values():
            visit(child, -1)
        return parents, tokens, counts

    def load_output_counts(self, parents: Sequence[int], tokens: Sequence[int], counts: Sequence[float]) -> None:
        """Add a node table written by :meth:`output_counts` (into an empty
        trie: the same output counts, the same children order)."""
        depth: list[int] = []
        for i, (parent, count) in enumerate(zip(parents, counts)):  # every check before any change
            if not -1 <= parent < i:
                raise ValueError("parents: every row's parent must be -1 or an earlier row")
            depth.append(1 if parent < 0 else depth[parent] + 1)
            if depth[-1] > self.knobs.branch_length:
                raise ValueError(f"row {i} is {depth[-1]} nodes deep: must be at most branch_length="
                                 f"{self.knobs.branch_length}")
            if not (math.isfinite(count) and count >= 0):
                raise ValueError(f"counts: row {i} has {count}: must be finite and >= 0")
        rows: list[_Node] = []
        for parent, token, count in zip(parents, tokens, counts):
            node = self._child(self.root if parent < 0 else rows[parent], int(token))
            node.out += float(count)
            rows.append(node)
        self._maybe_prune()

    # -------------------------------------------------------------- internals
    def _child(self, node: _Node, token: int) -> _Node:
        child = node.children.get(token)
        if child is None:
            self._serial += 1
            child = _Node(token, node, self._serial)
            node.children[token] = child
            self.num_nodes += 1
        return child

    def _walk(self, tokens: Sequence[int], create: bool) -> _Node | None:
        node = self.root
        for t in tokens:
            nxt = node.children.get(t)
            if nxt is None:
                if not create:
                    return None
                nxt = self._child(node, t)
            node = nxt
        return node

    def _insert_prompt(self, st: TrieRecord, prompt: Sequence[int]) -> None:
        lb = self.knobs.branch_length
        for i in range(len(prompt)):
            node = self.root
            for t in prompt[i:i + lb]:
                node = self._child(node, int(t))
                if node.prompt is None:
                    node.prompt = {}
                node.prompt[st.slot] = node.prompt.get(st.slot, 0) + 1
                node.ptotal += 1
                st.prompt_nodes[node] = st.prompt_nodes.get(node, 0) + 1

    def _extend_one(self, st: TrieRecord, token: int, count: float = 1.0) -> None:
        cursors = []
        for j, node in enumerate(st.cursors):
            if not node.alive:
                node = self._walk(st.window[j:], create=True)
            child = self._child(node, token)
            child.out += count
            cursors.append(child)
        first = self._child(self.root, token)
        first.out += count
        cursors.append(first)
        st.window.append(token)
        if len(st.window) >= self.knobs.branch_length:
            del st.window[0]
            del cursors[0]
        st.cursors = cursors

    def _drop_if_empty(self, node: _Node) -> None:
        while node is not self.root and node.alive and _is_empty(node):
            self._detach(node)
            node = node.parent

    def _detach(self, node: _Node) -> None:
        """Remove ``node`` and its subtree."""
        del node.parent.children[node.token]
        stack = [node]
        while stack:
            n = stack.pop()
            n.alive = False
            self.num_nodes -= 1
            stack.extend(n.children.values())

    def _maybe_prune(self) -> None:
        if self.num_nodes > self.knobs.trie_capacity:
            self.prune()

    def prune(self) -> None:
        """Decay output counts, drop light nodes, then lightest leaves to the target."""
        before = self.num_nodes
        target = int(self.knobs.trie_capacity * PRUNE_TARGET)
        nodes = list(_iter_nodes(self.root))  # pre-order: parents before descendants
        for node in nodes:
            node.out *= 0.5
        for node in reversed(nodes):  # bottom-up: a light node goes only once its subtree has
            if _is_empty(node):
                self._detach(node)
        if self.num_nodes > target:
            self._drop_lightest_leaves(self.num_nodes - target)
        self.num_prunes += 1
        logger.debug("trie pruned: %d -> %d nodes", before, self.num_nodes)

    def _drop_lightest_leaves(self, count: int) -> None:
        heap = [(_raw_weight(n), n.serial, n) for n in _iter_nodes(self.root) if not n.children]
        heapq.heapify(heap)
        while heap and count > 0:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._detach(node)
            count -= 1
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (_raw_weight(parent), parent.serial, parent))


def _is_empty(node: _Node) -> bool:
    """A leaf with no prompt count and an output count decayed below one."""
    return not node.children and node.ptotal == 0 and node.out < 1


def _raw_weight(node: _Node) -> float:
    return node.ptotal + node.out


def _children_total(parent: _Node) -> float:
    return sum(_raw_weight(c) for c in parent.children.values())


def _confidence(parent: _Node, child: _Node) -> float:
    """Smoothed estimate of P(child | parent) from raw counts (prompt weight ignored).

    One unit of smoothing: a continuation seen once gets 0.5, three times 0.75.
    """
    return _raw_weight(child) / (_children_total(parent) + 1.0)


def _depth(node: _Node) -> int:
    d = 0
    while node.parent is not None:
        node, d = node.parent, d + 1
    return d


def _iter_nodes(root: _Node):
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _flatten_dfs(start: _Node, picked: dict[_Node, float], confidence: dict[_Node, float]) -> DraftTree:
    """DFS order, children heaviest first, parents before children."""
    entries: list[tuple[_Node, int]] = []
    stack: list[tuple[_Node, int]] = [(c, -1) for c in _ranked(start, picked)[::-1]]
    while stack:
        node, parent = stack.pop()
        idx = len(entries)
        entries.append((node, parent))
        stack.extend((c, idx) for c in _ranked(node, picked)[::-1])
    return _draft_tree(entries, picked, confidence)


def _ranked(node: _Node, picked: dict[_Node, float]) -> list[_Node]:
    kids = [c for c in node.children.values() if c in picked]
    kids.sort(key=lambda c: (-picked[c], c.token))
    return kids


def _flatten_parallel(
    start: _Node, picked: dict[_Node, float], confidence: dict[_Node, float], budget: int
) -> DraftTree:
    """Whole root-to-leaf branches side by side (no merging), heaviest leaf first."""
    leaves = [n for n in picked if not any(c in picked for c in n.children.values())]
    leaves.sort(key=lambda n: (-picked[n], n.token))
    entries: list[tuple[_Node, int]] = []
    for leaf in leaves:
        path = []
        node = leaf
        while node is not start:
            path.append(node)
            node = node.parent
        for j, node in enumerate(path[::-1][: budget - len(entries)]):
            entries.append((node, -1 if j == 0 else len(entries) - 1))
    return _draft_tree(entries, picked, confidence)


def _draft_tree(
    entries: list[tuple[_Node, int]], picked: dict[_Node, float], confidence: dict[_Node, float]
) -> DraftTree:
    """``(node, parent index)`` pairs in draft order -> DraftTree."""
    return DraftTree(
        tuple(n.token for n, _ in entries),
        tuple(p for _, p in entries),
        tuple(picked[n] for n, _ in entries),
        tuple(confidence[n] for n, _ in entries),
    )


class NativeHandles(NativeTrie):
    """The native trie with its record-handle calls (the slot methods are made of them), the
    calls :class:`TokenTrie` answers too: tests run both through one program
    (:func:`native_trie`)."""

    @property
    def num_prunes(self) -> int:
        return self._core.num_prunes

    def add_request(self, prompt: Sequence[int]) -> int:
        return self._core.add_request(prompt)

    def finish_request(self, record: int) -> None:
        self._core.finish_request(record)

    def extend(self, record: int, tokens: Iterable[int]) -> None:
        self._core.extend(record, list(tokens))

    def retrieve(self, context: Sequence[int], budget: int | None = None, request: int | None = None,
                 shape: str | None = None, min_confidence: float | None = None) -> tuple[list, ...]:
        """One context's tree: its tokens, parents (-1: the root; parents first), weights and
        confidences."""
        budget = self.config.decoding_length if budget is None else budget
        floor = self.config.profile.min_draft_confidence if min_confidence is None else min_confidence
        return self._core.retrieve(list(context), budget, -1 if request is None else request,
                                   shape or self.config.draft_shape, floor)

    def retrieve_rows(self, records: Sequence[int | None], contexts: np.ndarray, context_lens: np.ndarray,
                      budgets: Sequence[int], floor: float, shape: str | None = None) -> tuple[np.ndarray, ...]:
        return self._core.retrieve_rows(_handles(records), contexts, context_lens, budgets, float(floor),
                                        shape or self.config.draft_shape)

    def extend_rows(self, records: Sequence[int], token_ids: np.ndarray, rows: Sequence[int], starts: Sequence[int],
                    ends: Sequence[int]) -> None:
        self._core.extend_rows(records, token_ids, rows, starts, ends)

    def context_rows(self, records: Sequence[int | None], budgets: Sequence[int], floor: float
                     ) -> tuple[np.ndarray, ...]:
        return self._core.context_rows(_handles(records), budgets, float(floor))

    def context_length(self, record: int) -> int:
        return self._core.context_length(record)

    def prune(self) -> None:
        self._core.prune()


def _handles(records: Sequence[int | None]) -> np.ndarray:
    """Native record handles as an array (None: no record, -1)."""
    return np.fromiter((-1 if r is None else r for r in records), np.int64, len(records))


def native_trie(config: Settings) -> NativeHandles:
    """The engine's native trie for ``config``, with the handle calls."""
    return make_trie(config, NativeHandles)
