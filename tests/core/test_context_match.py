"""Context match: the request's own earlier continuation of its last n-gram leads the draft."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_lab.reference.planner import best_chain
from lookahead_vllm.core.calibration import KIND_BRANCH, KIND_CHAIN, KIND_CONTEXT
from lookahead_lab.reference.trie import (
    RECENT_OCCURRENCES, ContextIndex, match_confidence,
)
from lookahead_vllm.core.drafter import rows_of
from lookahead_lab.reference.trees import DraftTree, fill_row
from lookahead_lab.reference import merge_rows, row_drafts

A, B, C, D, X, Y, Z = 1, 2, 3, 4, 5, 6, 7


def test_docstring_example():
    index = ContextIndex(2, [A, B, C, D, X, A, B])
    assert index.match() == (2, 2)
    chain = index.draft(4)
    assert chain.tokens == (C, D, X, A)
    assert chain.parents == (-1, 0, 1, 2)
    assert chain.confidence == pytest.approx([(2 / 3) ** d for d in range(1, 5)])  # a 2-token match


def test_no_earlier_occurrence_drafts_nothing():
    assert len(ContextIndex(2, [A, B, C, D]).draft(8)) == 0
    assert len(ContextIndex(3, [A, B]).draft(8)) == 0
    assert len(ContextIndex(2, [A, B, A, B]).draft(0)) == 0


def test_longest_backward_match_wins_then_the_most_recent():
    # "X A B" was followed by C, "Y A B" by D; the sequence ends "X A B".
    index = ContextIndex(2, [X, A, B, C, Y, A, B, D, Z, X, A, B])
    assert index.match() == (3, 3)
    assert index.draft(2).tokens == (C, Y)
    # Equal matches: the most recent occurrence.
    index = ContextIndex(2, [A, B, C, A, B, D, A, B])
    assert index.draft(1).tokens == (D,)


def test_extend_indexes_new_tokens_like_building_at_once():
    tokens = [A, B, C, A, B, D, Z, A, B, C, X, Y, A, B]
    whole = ContextIndex(2, tokens)
    grown = ContextIndex(2, tokens[:3])
    for t in tokens[3:]:
        grown.extend([t])
        assert grown.draft(5) == ContextIndex(2, grown.tokens).draft(5)
    assert grown.draft(5) == whole.draft(5) and len(grown) == len(tokens)


def test_periodic_text_continues_the_period():
    index = ContextIndex(2, [A, B, A, B, A])
    # What followed the latest "B A" runs into the end: the period repeats.
    assert index.draft(5).tokens == (B, A, B, A, B)
    index = ContextIndex(2, [X, A, B, C, A, B, C, A, B])
    assert index.draft(7).tokens == (C, A, B, C, A, B, C)


def test_only_recent_occurrences_are_kept():
    tokens = []
    for filler in range(RECENT_OCCURRENCES + 2):
        tokens += [A, B, 100 + filler]
    index = ContextIndex(2, tokens + [A, B])
    assert index.draft(1).tokens == (100 + RECENT_OCCURRENCES + 1,)
    assert len(index._next[(A, B)]) == RECENT_OCCURRENCES


def test_floor_cuts_the_chain():
    index = ContextIndex(1, [A, B, C, D, X, Y, Z, A])
    full = index.draft(6)
    assert len(full) == 6
    floor = match_confidence(1) ** 3
    assert index.draft(6, floor + 1e-9).tokens == full.tokens[:2]


@pytest.mark.parametrize("native", [False, True])
def test_chain_leads_and_trie_tree_merges_after_it(native):
    chain = ContextIndex(2, [A, B, C, D, X, A, B]).draft(3)  # C D X
    # Trie tree: C -> D -> Y (shares C D), and Z beside C.
    trie = DraftTree((C, D, Y, Z), (-1, 0, 1, -1), (5.0, 4.0, 3.0, 2.0), (0.6, 0.5, 0.4, 0.2))

    def merged(lead: DraftTree, budget: int, cut: bool = False) -> tuple[DraftTree, list[int]]:
        rows = [rows_of(1, 5), rows_of(1, 5)]
        fill_row(rows[0], 0, lead)
        fill_row(rows[1], 0, trie)
        out = merge_rows(rows[0], np.array([len(lead) > 0]), rows[1], np.array([budget]), np.array([cut]), native)
        return row_drafts(out)[0]

    tree, kinds = merged(chain, 5)
    assert tree.tokens == (C, D, X, Y, Z)
    assert tree.parents == (-1, 0, 1, 1, -1)
    assert best_chain(tree) == [C, D, X]  # chain mode follows the context chain
    assert kinds == [KIND_CONTEXT] * 3 + [KIND_BRANCH, KIND_BRANCH]
    assert merged(chain, 5, cut=True) == (DraftTree((C, D, X), (-1, 0, 1), chain.weights, chain.confidence),
                                          [KIND_CONTEXT] * 3)
    assert merged(DraftTree.empty(), 5) == (trie, [KIND_CHAIN] * 3 + [KIND_BRANCH])
    assert len(merged(chain, 3)[0]) == 3


def test_longer_matches_draft_with_higher_confidence():
    # Same continuation (C D), matched over 1 token and over 4.
    short = ContextIndex(1, [X, B, C, D, Y, B]).draft(2)
    long = ContextIndex(1, [Z, A, X, B, C, D, Y, Z, A, X, B]).draft(2)
    assert short.tokens == long.tokens == (C, D)
    assert short.confidence == pytest.approx([1 / 2, 1 / 4])
    assert long.confidence == pytest.approx([4 / 5, 16 / 25])
    assert [match_confidence(m) for m in (1, 3, 31)] == pytest.approx([0.5, 0.75, 31 / 32])


def test_min_match_validated():
    with pytest.raises(ValueError, match=r"min_match=0: must be >= 1"):
        ContextIndex(0)
