"""DraftIndex (its pure-Python reference, lookahead_lab.reference) and the native Drafter around it."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_lab.reference import padded_contexts, row_drafts
from lookahead_lab.reference.draft_index import DraftIndex
from lookahead_vllm.core.draft_index import ENTRY_CHARGE, KEY_CHARGE, SEQUENCE_CHARGE, TOKEN_CHARGE
from lookahead_vllm.core.drafter import Drafter
from tests.settings import index_config, lookahead_settings

A, B, C, D, X = 1, 2, 3, 4, 9


def test_worked_example_of_the_docstring():
    ix = DraftIndex(index_config(ngram=2))
    ix.add(0, [A, B, C, D, X, A, B], 7)
    tokens, parents, conf = ix.draft(0, 3)
    assert tokens == [C, D, X] and parents == [-1, 0, 1]
    assert conf == pytest.approx([2 / 3, (2 / 3) ** 2, (2 / 3) ** 3])


def test_own_continuation_repeats_its_period_at_the_texts_end():
    ix = DraftIndex(index_config(ngram=2))
    ix.add(0, [5, A, B, A, B, A], 6)
    assert ix.draft(0, 5)[0] == [B, A, B, A, B]


def test_longest_match_wins_and_floor_cuts():
    ix = DraftIndex(index_config(ngram=2, max_candidates=1))
    # "x a b" -> c (match 3) beats the more recent "y a b" -> d (match 2).
    ix.add(0, [X, A, B, C, 7, 8, A, B, D, 6, X, A, B], 13)
    tokens, _, conf = ix.draft(0, 4)
    assert tokens[0] == C
    floor = conf[1] + 1e-9
    assert ix.draft(0, 4, floor=floor)[0] == tokens[:1]


def test_agreeing_candidates_weigh_more_and_trees_keep_the_runner_up():
    ix = DraftIndex(index_config(ngram=2))
    ix.add(0, [A, B, C, 8, A, B, C, 8, A, B, D, 8, A, B], 14)
    chain, _, conf = ix.draft(0, 2)
    assert chain == [C, 8] and conf[0] < 1.0  # two of three matches agree on c
    tokens, parents, tconf = ix.draft(0, 4, tree=True)
    assert tokens[0] == C and D in tokens and parents.count(-1) == 2
    assert all(parents[i] < i for i in range(len(parents)))


def test_corpus_serves_other_requests_outputs_and_evicts_oldest():
    # An output of 6 tokens has 4 n-grams of 2 after its first 2 tokens: 4 entries, here under 4 keys.
    six = SEQUENCE_CHARGE + 6 * TOKEN_CHARGE + 4 * (ENTRY_CHARGE + KEY_CHARGE)
    two = SEQUENCE_CHARGE + 2 * TOKEN_CHARGE
    cfg = index_config(ngram=2, corpus_bytes=six + two + 72)
    ix = DraftIndex(cfg)
    answer = [20, 21, 22, 23, 24, 25]
    ix.add(0, [7, 7] + answer, 2)  # prompt 7 7, output = answer
    ix.add(1, [6, 6, 20, 21], 2)
    assert ix.draft(1, 4)[0] == [22, 23, 24, 25]  # a running request's output is visible
    assert ix.corpus_bytes() == 4 * (ENTRY_CHARGE + KEY_CHARGE)  # its entries are charged while it runs
    ix.finish(0)
    assert ix.num_live() == 1 and ix.corpus_tokens() == 6 and ix.corpus_bytes() == six
    assert ix.draft(1, 4)[0] == [22, 23, 24, 25]  # and stays after it finished
    ix.finish(1)  # a 2-token output: six + two is within the cap
    assert ix.corpus_bytes() == six + two
    ix.add(2, [5, 5] + list(range(40, 46)), 2)
    ix.finish(2)  # two six-token outputs are over the cap: request 0's output, the oldest, is evicted
    assert ix.corpus_tokens() == 8 and ix.num_sequences() == 2 and ix.corpus_bytes() == two + six
    ix.add(3, [1, 1, 20, 21], 2)
    assert ix.draft(3, 4)[0] == []


def test_charge_prices_shared_keys_once_and_dropped_entries_not_at_all():
    """Entries of one key share its charge; entries past max_occurrences leave
    the corpus and their charge; a running output is never evicted."""
    ix = DraftIndex(index_config(ngram=1, max_occurrences=2, corpus_bytes=0))
    ix.add(0, [9] + [5] * 6, 1)  # output 5 5 5 5 5 5: entries at 1..5 under key (5,), the 2 newest kept
    ix.settle()
    assert ix.corpus_bytes() == 2 * ENTRY_CHARGE + KEY_CHARGE and ix.num_sequences() == 1
    ix.finish(0)
    assert ix.corpus_bytes() == 0 and ix.corpus_tokens() == 0 and ix.num_sequences() == 0


def test_upkeep_runs_after_the_batch_drafts():
    """draft_batch drafts before the pending upkeep: another request's new
    output n-grams join the corpus, and a finished output over the cap
    leaves it, only after the batch call that follows them."""
    ix = DraftIndex(index_config(ngram=2, corpus_bytes=0))
    table = np.array([[7, 5, 6, 1, 2, 9], [3, 1, 2, 0, 0, 0]], np.int32)
    ix.sync([0, 1], [0, 1], table, [6, 3], [1, 3])  # output 5 6 1 2 9 follows 1 2 with 9
    assert ix.draft_batch([1], [4])[3].tolist() == [0]  # not yet in the corpus
    assert ix.draft_batch([1], [4])[0].tolist() == [[9, 0, 0, 0]]  # the upkeep after the first call
    ix.finish(0)  # over the cap of 0: evicted by the next upkeep, not now
    assert ix.draft_batch([1], [4])[0][0, 0] == 9
    assert ix.draft_batch([1], [4])[3].tolist() == [0]
    assert ix.corpus_tokens() == 0 and ix.num_sequences() == 1
    single = DraftIndex(index_config(ngram=2))
    single.sync([0, 1], [0, 1], table, [6, 3], [1, 3])
    assert single.draft(1, 4)[0] == [9]  # one draft (like add, extend, sync, the counts) settles first


def test_rewind_equals_a_fresh_index_of_the_prefix():
    text = [A, B, C, D, A, B, C, X, A, B, C]
    ix = DraftIndex(index_config(ngram=2))
    ix.add(0, text, 4)
    ix.rewind(0, 7)
    fresh = DraftIndex(index_config(ngram=2))
    fresh.add(0, text[:7], 4)
    assert ix.length(0) == 7
    assert ix.draft(0, 6, tree=True) == fresh.draft(0, 6, tree=True)
    assert ix.memory_bytes() == fresh.memory_bytes()


def test_finish_leaves_no_running_state_and_ids_are_checked():
    ix = DraftIndex(index_config(ngram=2))
    ix.add(0, [A, B, C], 3)
    with pytest.raises(KeyError):
        ix.add(0, [A], 1)
    ix.finish(0)
    ix.finish(0)  # idempotent
    assert ix.num_live() == 0 and ix.draft(0, 4) == ([], [], [])
    with pytest.raises(ValueError, match="prompt_len=5"):
        ix.add(1, [A, B], 5)


@pytest.mark.parametrize("field,value", [("ngram", 0), ("ngram", 5), ("max_candidates", 0), ("corpus_bytes", -1),
                                         ("corpus_bytes", 1 << 41)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field}={value}"):
        index_config(**{field: value})


def test_sync_admits_extends_and_rewinds_from_the_token_table():
    ix = DraftIndex(index_config(ngram=2))
    table = np.zeros((3, 16), np.int32)
    table[2, :8] = [A, B, C, D, A, B, C, D]
    assert ix.sync([7], [2], table, [6], [4]) == 0  # admitted
    assert ix.length(7) == 6
    assert ix.sync([7], [2], table, [8], [4]) == 0  # extended
    assert ix.length(7) == 8 and ix.draft(7, 2)[0] == [A, B]
    assert ix.sync([7], [2], table, [5], [4]) == 1  # rewound (counted)
    assert ix.length(7) == 5


def test_draft_batch_rows_equal_single_drafts():
    ix = DraftIndex(index_config(ngram=2))
    ix.add(0, [A, B, C, D, A, B], 6)
    ix.add(1, [5, 6, 7, 5, 6], 5)
    tokens, parents, conf, lengths = ix.draft_batch([1, 0, 9], [3, 2, 4])
    assert tokens.shape == (3, 4) and list(lengths) == [3, 2, 0]
    assert tokens[0, :3].tolist() == ix.draft(1, 3)[0] and tokens[1, :2].tolist() == [C, D]
    assert conf[1, :2].tolist() == ix.draft(0, 2)[2]


def test_drafter_index_and_trie_sources():
    table = np.zeros((1, 32), np.int64)
    text = [A, B, C, D, X, A, B, C]
    table[0, :len(text)] = text
    for source in ("index", "trie", "index+trie"):
        drafter = Drafter(lookahead_settings(source=source, min_draft_confidence=0.0))
        drafter.sync([0], [0], table, [len(text)], [len(text)])
        ((tree, kinds),) = row_drafts(drafter.draft([0], padded_contexts([text[-6:]]), [3], 0.0, tree=False))
        assert list(tree.tokens[:2]) == [D, X], source
        assert len(kinds) == len(tree)
        drafter.finish(0)
        assert drafter.num_requests() == 0


def test_drafter_warm_start_drafts_past_answers():
    drafter = Drafter(lookahead_settings())
    drafter.warm([30, 31, 32, 33, 34, 35])
    table = np.array([[8, 8, 30, 31, 32]], np.int64)
    drafter.sync([0], [0], table, [5], [5])
    ((tree, _),) = row_drafts(drafter.draft([0], None, [3], 0.0, tree=False))
    assert list(tree.tokens) == [33, 34, 35]


def test_trailing_contexts_gather_each_rows_last_tokens():
    """The proposer's trie contexts in one gather, held to the list slices they replace."""
    from lookahead_vllm.core.drafter import trailing_contexts

    rng = np.random.default_rng(0)
    table = rng.integers(1, 1000, size=(6, 40))
    for width in (1, 3, 6):
        rows = np.array([5, 0, 2, 3])
        ends = np.array([40, 1, 4, 0])
        got = trailing_contexts(table, rows, ends, width)
        want = padded_contexts([table[r, max(0, e - width):e].tolist() for r, e in zip(rows, ends)])
        assert got[1].tolist() == want[1].tolist()
        for g, w, n in zip(got[0], want[0], want[1]):
            assert g[:n].tolist() == w[:n].tolist()
    empty = trailing_contexts(table, np.array([], np.int64), np.array([], np.int64), 4)
    assert empty[0].shape == (0, 4) and empty[1].shape == (0,)
