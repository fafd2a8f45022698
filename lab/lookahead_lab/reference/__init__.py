"""Pure-Python references of the native drafting core, the oracles tests hold
``lookahead_vllm._draft_index`` to (the plugin itself always runs the native
core).

:data:`extension` has the extension module's interface: ``DraftIndex`` and
``TokenTrie`` with the native constructors and methods, and the planner's
batch kernels (``merge_rows``, ``plan_trees``, ``match_trees``,
``observe_trees``, ``walk_trees``). :func:`reference_core` swaps it in for the extension
(``lookahead_vllm.core.native.extension``) within a block, and
:func:`on_reference` builds a whole proposer that runs on it, to drive beside
a native one and compare step by step.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from types import SimpleNamespace
from typing import Sequence

import numpy as np

from lookahead_vllm.core import calibration
from lookahead_vllm.core.calibration import ConfidenceCalibrator
from lookahead_vllm.core.draft_index import DraftIndexConfig
from lookahead_lab.reference.trees import DraftTree
from lookahead_lab.reference import planner
from lookahead_lab.reference.draft_index import DraftIndex as ReferenceDraftIndex
from lookahead_lab.reference.jacobi import JacobiTable
from lookahead_lab.reference.planner import row_tree
from lookahead_lab.reference.trie import TokenTrie, TrieRecord


def _draft_index(ngram: int, max_match: int, max_occurrences: int, max_candidates: int, corpus_bytes: int,
                 upkeep_thread: bool = False) -> ReferenceDraftIndex:
    return ReferenceDraftIndex(DraftIndexConfig(ngram, max_match, max_occurrences, max_candidates, corpus_bytes))


class _TrieCore:
    """The native trie core's interface over the reference :class:`TokenTrie`:
    requests are int handles into a table of :class:`TrieRecord`."""

    def __init__(self, branch_length: int, max_match_length: int, min_match_length: int, min_retrieved_nodes: int,
                 trie_capacity: int, prompt_weight: float, insert_prompt: bool, context_match: int) -> None:
        knobs = SimpleNamespace(branch_length=branch_length, max_match_length=max_match_length,
                                min_match_length=min_match_length, min_retrieved_nodes=min_retrieved_nodes,
                                trie_capacity=trie_capacity, prompt_weight=prompt_weight,
                                insert_prompt=insert_prompt, context_match=context_match, min_draft_confidence=0.0)
        self.trie = TokenTrie(SimpleNamespace(profile=knobs, decoding_length=0, draft_shape="hier"))
        self._records: dict[int, TrieRecord] = {}
        # The caller's slots (sync): slot -> [record handle (None: kept off the trie), tokens inserted,
        # the most it ever inserted (a rewound request's tokens up to there are not counted again)].
        self._slots: dict[int, list] = {}

    num_nodes = property(lambda self: self.trie.num_nodes)
    num_prunes = property(lambda self: self.trie.num_prunes)

    def _records_of(self, handles: Sequence[int]) -> list[TrieRecord | None]:
        return [self._records.get(int(h)) for h in handles]

    def memory_bytes(self) -> int:
        return self.trie.num_bytes

    def add_request(self, prompt: Sequence[int]) -> int:
        record = self.trie.add_request(list(prompt))
        self._records[record.slot] = record
        return record.slot

    def finish_request(self, handle: int) -> None:  # idempotent, as the native core's
        record = self._records.pop(handle, None)
        if record is not None:
            self.trie.finish_request(record)

    def extend(self, handle: int, tokens: Sequence[int], uncounted: int = 0) -> None:
        self.trie.extend(self._records[handle], tokens, uncounted)

    def insert_output(self, tokens: Sequence[int]) -> None:
        self.trie.insert_output(list(tokens))

    def retrieve(self, context, budget, handle, shape, floor):
        tree = self.trie.retrieve(list(context), budget, self._records.get(handle), shape, floor)
        return tree.tokens, tree.parents, tree.weights, tree.confidence

    def retrieve_rows(self, handles, contexts, lens, budgets, floor, shape):
        return self.trie.retrieve_rows(self._records_of(handles), contexts, lens, budgets, floor, shape)

    def extend_rows(self, handles, token_ids, rows, starts, ends) -> None:
        self.trie.extend_rows(self._records_of(handles), token_ids, rows, starts, ends)

    def context_rows(self, handles, budgets, floor):
        return self.trie.context_rows(self._records_of(handles), budgets, floor)

    def context_length(self, handle: int) -> int:
        return self.trie.context_length(self._records[handle])

    # The engine's requests by the caller's slot: what TokenTrie::sync and its
    # companions do natively (csrc/draft_index/token_trie.h).
    def sync(self, sids, rows, token_ids, num_tokens, prompt_lens, partitions=None, sampled=None) -> int:
        """Row by row: a slot of another partition than the default is kept off the shared
        trie; an unknown slot is admitted (its prompt as of this step, then the rest as
        output), a known one extended, or started over where the row is shorter than what it
        inserted, or it inserted more than the tokens before the row's last ``sampled[i]``
        (None: none; sampled this step) (a rewind, counted)."""
        rewound = 0
        parts = [0] * len(sids) if partitions is None else list(partitions)
        fresh = [0] * len(sids) if sampled is None else list(sampled)
        for sid, row, n, plen, part, new in zip(map(int, sids), map(int, rows), map(int, num_tokens),
                                                map(int, prompt_lens), map(int, parts), map(int, fresh)):
            if part != 0:
                self._slots.setdefault(sid, [None, 0, 0])
                continue
            rec, counted = self._slots.get(sid), 0
            if rec is not None and n - new < rec[1]:
                rewound += 1
                counted = max(rec[2], rec[1])
                self.finish_slot(sid)
                rec = None
            if rec is None:
                prompt = min(plen, n)
                rec = self._slots[sid] = [self.add_request(token_ids[row, :prompt].tolist()), prompt, counted]
            if n > rec[1]:
                self.extend(rec[0], token_ids[row, rec[1]:n].tolist(), min(max(rec[2] - rec[1], 0), n - rec[1]))
                rec[1] = n
        return rewound

    def finish_slot(self, sid: int) -> None:
        rec = self._slots.pop(int(sid), None)
        if rec is not None and rec[0] is not None:
            self.finish_request(rec[0])

    def _slot_handle(self, sid: int) -> int:
        """The slot's record handle (-1: never synced; -2: kept off the trie), as TokenTrie::slot_handle."""
        rec = self._slots.get(int(sid))
        return -1 if rec is None else -2 if rec[0] is None else rec[0]

    def retrieve_slots(self, sids, contexts, lens, budgets, floor, shape):
        handles = np.array([self._slot_handle(s) for s in sids], np.int64)
        on = (handles != -2).astype(np.uint8)
        kept = np.where(on.astype(bool), np.asarray(budgets, np.int64), 0)
        return (*self.retrieve_rows(np.maximum(handles, -1), contexts, lens, kept, floor, shape), on)

    def context_slots(self, sids, budgets, floor):
        return self.context_rows([max(self._slot_handle(s), -1) for s in sids], budgets, floor)

    def slot_context_length(self, sid: int) -> int:
        handle = self._slot_handle(sid)
        return -1 if handle < 0 else self.context_length(handle)

    num_slots = property(lambda self: len(self._slots))
    num_slot_contexts = property(lambda self: 0 if not self.trie.knobs.context_match else sum(
        rec[0] is not None for rec in self._slots.values()))

    def output_counts(self):
        return self.trie.output_counts()

    def load_output_counts(self, parents, tokens, counts) -> None:
        self.trie.load_output_counts(parents, tokens, counts)

    def prune(self) -> None:
        self.trie.prune()


# Calls into :data:`extension` by name, so a test can check that the reference side ran each kernel.
calls: Counter = Counter()


def _counted(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return call


# The extension module's interface, in Python.
extension = SimpleNamespace(**{name: _counted(name, fn) for name, fn in (
    ("DraftIndex", _draft_index), ("TokenTrie", _TrieCore), ("merge_rows", planner.merge_rows),
    ("plan_trees", planner.plan_trees), ("match_trees", planner.match_trees), ("observe_trees", planner.observe_trees),
    ("walk_trees", planner.walk_trees), ("JacobiTable", JacobiTable),
)})


def padded_contexts(contexts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists as ``Drafter.draft``'s ``contexts``: ``(tokens [R, W], lengths [R])``."""
    lens = np.fromiter((len(c) for c in contexts), np.int64, len(contexts))
    out = np.zeros((len(contexts), max(1, int(lens.max(initial=0)))), np.int64)
    for i, c in enumerate(contexts):
        out[i, :len(c)] = c
    return out, lens


def row_drafts(rows: tuple[np.ndarray, ...]) -> list[tuple[DraftTree, list[int]]]:
    """``Drafter.draft``'s rows as one ``(DraftTree, kinds)`` per request."""
    tok, par, weights, conf, kinds, lens = rows
    return [(row_tree((tok, par, weights, conf, lens), i), kinds[i, :lens[i]].tolist()) for i in range(len(lens))]


def kernels(native: bool):
    """The extension (``native``) or :data:`extension`."""
    from lookahead_vllm.core import native as core_native

    return core_native.extension() if native else extension


def merge_rows(lead, lead_context, trie, budgets, cut, native: bool, pool=None) -> tuple[np.ndarray, ...]:
    """``merge_rows`` of the extension or of the reference, its arguments
    converted as ``Drafter.draft`` converts them."""
    return kernels(native).merge_rows(lead, np.asarray(lead_context, np.uint8), trie, np.asarray(budgets, np.int64),
                                      None if cut is None else np.asarray(cut, np.uint8), pool)


@contextlib.contextmanager
def reference_core():
    """Within the block, everything reaches :data:`extension` instead of the extension. The
    swap is process-wide (a module attribute): not for threads that call the extension meanwhile
    (the native core's upkeep thread is C++ and does not)."""
    from lookahead_vllm.core import native as core_native

    saved = core_native.extension
    core_native.extension = lambda: extension
    try:
        yield
    finally:
        core_native.extension = saved


def plan_trees(*args, native: bool, **kwargs):
    """``tree_plan.plan_trees`` on the extension or on the reference."""
    from lookahead_vllm.core.tree_plan import plan_trees as plan

    with contextlib.nullcontext() if native else reference_core():
        return plan(*args, **kwargs)


def drafter(config, native: bool):
    """A ``Drafter`` whose index and trie are native or the references
    (merging is native either way)."""
    from lookahead_vllm.core.drafter import Drafter

    with contextlib.nullcontext() if native else reference_core():
        return Drafter(config)


def match(offers, slots, scheduled, emitted, native: bool):
    """``TreeOffers.match`` on the extension or on the reference."""
    return kernels(native).match_trees(offers.slots, offers.lengths, offers.tokens, offers.parents, slots,
                                       scheduled, emitted)


class ReferenceCalibrator(ConfidenceCalibrator):
    """``ConfidenceCalibrator`` booking through the reference kernels, with
    the per-tree forms tests state the rule in (``calibrate``, ``observe``)."""

    def calibrate(self, tree: DraftTree, kinds: Sequence[int]) -> list[float]:
        return planner.calibrate(tree, kinds, self._factor)

    def observe_nodes(self, kinds, raw, accepted) -> None:
        if self.learns:
            planner.observe_nodes(self.predicted, self.accepted, self.nodes, self._factor, np.asarray(kinds, np.int64),
                                  np.asarray(raw, np.float64), np.asarray(accepted, bool), self.prior,
                                  float(calibration.HALF_LIFE_NODES))

    def observe(self, tree: DraftTree, kinds: Sequence[int], accepted: Sequence[int]) -> None:
        hit = set(accepted)
        self.observe_nodes(kinds, [tree.node_confidence(i) for i in range(len(kinds))],
                           [i in hit for i in range(len(kinds))])

    def observe_trees(self, raw, kinds, accepted, at, verified) -> None:
        if self.learns:
            planner.observe_trees(self.predicted, self.accepted, self.nodes, self._factor, self.bin_edges, raw, kinds,
                                  accepted, at, verified, self.prior, float(calibration.HALF_LIFE_NODES))


class OnReference:
    """``obj`` whose every method call runs inside :func:`reference_core`
    (attributes pass through unwrapped, so calls on them do not): a proposer
    built so runs its whole pipeline on the references beside a native one
    when driven through its own methods, as the runner drives it."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name: str):
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with reference_core():
                return attr(*args, **kwargs)
        return call


def on_reference(build):
    """``build()`` made inside :func:`reference_core`, as an :class:`OnReference`."""
    with reference_core():
        return OnReference(build())
