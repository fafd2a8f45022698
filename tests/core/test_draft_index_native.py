"""The native DraftIndex (lookahead_vllm._draft_index) against the pure-Python
reference: the same operation sequences give identical drafts (tokens,
parents, confidences bit for bit) and counts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lookahead_vllm
from lookahead_lab.reference.draft_index import DraftIndex
from lookahead_vllm.core import native
from lookahead_vllm.core.draft_index import DraftIndexConfig
from tests.settings import index_config

NativeDraftIndex = native.extension().DraftIndex

SIDS = range(6)
# Real text that stays put (a past README of this project), unlike the README itself.
TEXT = Path(__file__).resolve().parents[1] / "data" / "real_text.md"


def _pair(cfg: DraftIndexConfig, upkeep_thread: bool = False):
    return DraftIndex(cfg), native.make_draft_index(cfg, upkeep_thread=upkeep_thread)


def _same_outcome(ref, nat, method: str, *args, **kwargs):
    """Calls `method` on both; they must return equal results or raise the same type."""
    outcomes = []
    for index in (ref, nat):
        try:
            outcomes.append(("ok", getattr(index, method)(*args, **kwargs)))
        except (KeyError, ValueError) as exc:
            outcomes.append(("raise", type(exc)))
    (kind_r, out_r), (kind_n, out_n) = outcomes
    assert kind_r == kind_n and (kind_r == "ok" or out_r is out_n), (method, args, outcomes)
    return out_r, out_n


def _assert_same_state(ref, nat, sids=SIDS, settle=True):
    """Equal counts and lengths; with ``settle``, also the corpus counts
    (which settle the pending upkeep first)."""
    assert nat.num_live() == ref.num_live()
    assert [nat.length(s) for s in sids] == [ref.length(s) for s in sids]
    if settle:
        assert nat.num_sequences() == ref.num_sequences()
        assert nat.corpus_tokens() == ref.corpus_tokens()
        assert nat.corpus_bytes() == ref.corpus_bytes()
        assert nat.corpus_sequences() == ref.corpus_sequences()


def _assert_same_batch(out_r, out_n):
    for a, b, dtype in zip(out_r, out_n, (np.int32, np.int32, np.float64, np.int32)):
        assert b.dtype == dtype and b.shape == a.shape
        assert np.array_equal(a, b), (a, b)


configs = st.builds(
    lambda n, extra, occ, cands, corpus: DraftIndexConfig(n, n + extra, occ, cands, corpus),
    st.integers(1, 4), st.integers(0, 6), st.integers(1, 4), st.integers(1, 5), st.integers(0, 3000))


def _tokens(data, vocab, lo=0, hi=10):
    return data.draw(st.lists(st.integers(0, vocab - 1), min_size=lo, max_size=hi))


def _sync_table(data, ref, vocab, pool=SIDS):
    """A runner token table for some sequences of ``pool``: known ones
    rewound and/or extended, unknown ones admitted."""
    sids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
    texts, prompt_lens = [], []
    for sid in sids:
        seq = ref._live.get(sid)
        have = list(seq.tokens) if seq is not None else []
        keep = data.draw(st.integers(max(0, len(have) - 3), len(have)))
        texts.append(have[:keep] + _tokens(data, vocab, 0, 4))
        prompt_lens.append(data.draw(st.integers(0, len(texts[-1]) + 1)))
    width = max(len(t) for t in texts) + data.draw(st.integers(0, 2))
    dtype = data.draw(st.sampled_from([np.int32, np.int64]))
    order = data.draw(st.sampled_from(["C", "F"]))
    rows = data.draw(st.permutations(range(len(sids) + 1)))[:len(sids)]
    table = np.full((len(sids) + 1, width), 99, dtype=dtype, order=order)
    for row, text in zip(rows, texts):
        table[row, :len(text)] = text
    return sids, rows, table, [len(t) for t in texts], prompt_lens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, vocab=st.integers(2, 4), upkeep_thread=st.booleans(), data=st.data())
def test_random_operations_match_reference(cfg, vocab, upkeep_thread, data):
    """Also with the upkeep on its thread, and with sync + draft_batch steps
    whose upkeep is left pending across finishes and further steps."""
    ref, nat = _pair(cfg, upkeep_thread)
    sid = st.sampled_from(SIDS)
    for _ in range(data.draw(st.integers(5, 40))):
        op = data.draw(st.sampled_from(["add", "add", "extend", "extend", "finish", "rewind", "draft", "batch",
                                        "sync", "step", "step"]))
        if op == "add":
            tokens = _tokens(data, vocab, 0, 14)
            _same_outcome(ref, nat, "add", data.draw(sid), tokens, data.draw(st.integers(0, len(tokens) + 1)))
        elif op == "extend":
            _same_outcome(ref, nat, "extend", data.draw(sid), _tokens(data, vocab, 0, 5))
        elif op == "finish":
            _same_outcome(ref, nat, "finish", data.draw(sid))
        elif op == "rewind":
            _same_outcome(ref, nat, "rewind", data.draw(sid), data.draw(st.integers(0, 16)))
        elif op == "draft":
            args = (data.draw(sid), data.draw(st.integers(-1, 10)), data.draw(st.sampled_from([0.0, 0.05, 0.3])),
                    data.draw(st.booleans()))
            out_r, out_n = _same_outcome(ref, nat, "draft", *args)
            assert out_n == out_r, args
        elif op in ("batch", "step"):
            if op == "step":  # the engine's step: sync, then the batch's drafts
                out_r, out_n = _same_outcome(ref, nat, "sync", *_sync_table(data, ref, vocab))
                assert out_n == out_r
            sids = data.draw(st.lists(sid, max_size=5))
            budgets = data.draw(st.lists(st.integers(0, 10), min_size=len(sids), max_size=len(sids)))
            floor, tree = data.draw(st.sampled_from([0.0, 0.1])), data.draw(st.booleans())
            _assert_same_batch(ref.draft_batch(sids, budgets, floor, tree), nat.draft_batch(sids, budgets, floor, tree))
        else:  # both count the sequences the table rewound
            out_r, out_n = _same_outcome(ref, nat, "sync", *_sync_table(data, ref, vocab))
            assert out_n == out_r
        _assert_same_state(ref, nat, settle=data.draw(st.booleans()))
    for s in SIDS:  # every live sequence's draft at the end, both shapes
        for tree in (False, True):
            assert nat.draft(s, 12, 0.0, tree) == ref.draft(s, 12, 0.0, tree)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, vocab=st.integers(2, 5), data=st.data())
def test_batch_with_backoff_matches_reference(cfg, vocab, data):
    """draft_batch with a back-off index (one key length shorter, as the
    Drafter pairs them) drafts, for rows the main index has no candidate for,
    exactly what the reference does, natively in the same call. Syncs may say
    how many of each row's last tokens were sampled this step (both indexes
    then rewind to before them where they hold more)."""
    if cfg.ngram == 1:
        cfg = DraftIndexConfig(2, max(cfg.max_match, 2), cfg.max_occurrences, cfg.max_candidates, cfg.corpus_bytes)
    short = DraftIndexConfig(cfg.ngram - 1, cfg.max_match, cfg.max_occurrences, cfg.max_candidates, cfg.corpus_bytes)
    (ref, nat), (ref_b, nat_b) = _pair(cfg), _pair(short)
    running = list(SIDS)
    for _ in range(data.draw(st.integers(3, 25))):
        if len(running) > 1 and data.draw(st.booleans()):  # a finished id is never synced again
            done = data.draw(st.sampled_from(running))
            running.remove(done)
            for index in (ref, nat, ref_b, nat_b):
                index.finish(done)
        table = _sync_table(data, ref, vocab, running)
        sampled = data.draw(st.none() | st.just([data.draw(st.integers(0, min(3, n))) for n in table[3]]))
        # The reference's two indexes one by one, the native pair in one call.
        rewound = ref.sync(*table, sampled=sampled)
        ref_b.sync(*table, sampled=sampled)
        assert nat.sync(*table, backoff=nat_b, sampled=sampled) == rewound
        for sid in SIDS:
            assert (nat.length(sid), nat_b.length(sid)) == (ref.length(sid), ref_b.length(sid))
        sids = data.draw(st.lists(st.sampled_from(SIDS), max_size=5))
        budgets = data.draw(st.lists(st.integers(0, 8), min_size=len(sids), max_size=len(sids)))
        floor, tree = data.draw(st.sampled_from([0.0, 0.2, 0.6])), data.draw(st.booleans())
        # Before the batch call (which runs the upkeep): each row's own draft,
        # or the back-off's where the main index has no candidate.
        expect = []
        for sid, budget in zip(sids, budgets):
            row = ref._draft(sid, budget, floor, tree)
            row = ref_b._draft(sid, budget, floor, tree) if row is None else row
            expect.append(len(row[0]) if row else 0)
        want = ref.draft_batch(sids, budgets, floor, tree, backoff=ref_b)
        assert want[3].tolist() == expect
        _assert_same_batch(want, nat.draft_batch(sids, budgets, floor, tree, backoff=nat_b))
    with pytest.raises(ValueError, match="backoff"):
        nat.draft_batch([0], [4], backoff=nat)
    for index in (ref, nat):
        with pytest.raises(ValueError, match="backoff"):
            index.sync(*table, backoff=index)
        with pytest.raises(ValueError, match=r"sampled"):
            index.sync(*table, sampled=[n + 1 for n in table[3]])
    with pytest.raises(ValueError, match=r"sampled\[0\]=3: must be in \[0, num_tokens\[0\]=2\]"):
        nat.sync([0], [0], np.array([[1, 2]]), [2], [1], sampled=[3])


def test_tokens_sampled_in_place_of_dropped_ones_are_read_again():
    """A runner that dropped a row's last tokens (a failed KV load) samples others in their place, as many or fewer:
    told how many of the row's tokens this step sampled, the index rewinds to before them and reads them again,
    where counting tokens alone sees nothing (the same count) or keeps the dropped ones (fewer)."""
    cfg = DraftIndexConfig(2, 8, 4, 4, 0)
    text = [1, 2, 3, 4, 5] * 3
    for index in _pair(cfg):
        table = np.array([text + [1, 2]])
        index.sync([0], [0], table, [17], [15])
        table[0, 15:17] = [4, 9]  # the two sampled tokens replaced
        assert index.sync([0], [0], table, [17], [15]) == 0  # by count: nothing to do
        assert index.draft(0, 3, 0.0, False)[0] == [3, 4, 5]  # still drafting after "1 2"
        assert index.sync([0], [0], table, [17], [15], sampled=[2]) == 1
        assert index.draft(0, 3, 0.0, False)[0] == []  # "4 9" is new: no earlier occurrence
        table[0, 15] = 1  # one token fewer, sampled in place of the "4" held: by count the index would keep "4"
        assert index.sync([0], [0], table, [16], [15], sampled=[1]) == 1
        assert index.draft(0, 3, 0.0, False)[0] == [2, 3, 4]  # after "5 1"


def test_backoff_drafts_only_where_the_main_index_has_no_candidate():
    """A row whose candidates the floor cuts keeps its empty draft; a row
    with none takes the back-off index's (reference and native alike)."""
    for make in (DraftIndex, native.make_draft_index):
        main, back = make(index_config(ngram=2)), make(index_config(ngram=1))
        for index in (main, back):
            index.add(0, [1, 2, 3, 9, 5, 1, 2, 4, 7, 1, 2], 0)  # key (1, 2): two continuations, 3 and 4
            index.add(1, [5, 6, 7, 8, 6], 0)  # key (8, 6) unseen; key (6,) continues 7 8 6
        tok, _, conf, lens = main.draft_batch([0, 1], [4, 4], 0.0, backoff=back)
        assert lens[1] == 4 and tok[1].tolist() == [7, 8, 6, 7]  # the period 7 8 6 repeats
        assert lens[0] > 0
        high = float(conf[0, 0]) + 1e-9  # above the main index's first node
        _, _, _, cut = main.draft_batch([0, 1], [4, 4], high, backoff=back)
        assert cut[0] == 0


@pytest.mark.parametrize("make", ["reference", "native", "native-thread"])
def test_upkeep_pushes_before_it_evicts(make):
    """The upkeep's order: a finished output's pending push drops the
    oldest entry of a full key (one occurrence kept) before the eviction
    removes that output, so the key ends up empty."""
    cfg = index_config(ngram=2, max_occurrences=1, corpus_bytes=200)
    ix = DraftIndex(cfg) if make == "reference" else native.make_draft_index(cfg, make == "native-thread")
    ix.add(0, [7, 1, 2, 5], 1)  # running; its output 1 2 5 follows 1 2 with 5
    ix.add(1, [3, 1, 2], 3)  # drafts from the corpus
    ix.add(2, [8], 1)
    ix.extend(2, [1, 2, 6])  # pending: 1 2 -> 6
    ix.finish(2)  # pending: its eviction (a 3-token output is charged over 200 bytes)
    assert ix.draft_batch([1], [2])[0].tolist() == [[5, 0]]
    assert ix.draft_batch([1], [2])[3].tolist() == [0]
    assert ix.corpus_tokens() == 0 and ix.num_sequences() == 2


@pytest.mark.parametrize("upkeep_thread, ngram, occurrences, candidates",
                         [(False, 3, 8, 6), (True, 3, 8, 6), (False, 1, 64, 80)],
                         ids=["inline", "thread", "wide"])
def test_real_text_stream_matches_reference(upkeep_thread, ngram, occurrences, candidates):
    """Requests over real text bytes: prompts admitted and outputs committed 1-3
    tokens a step through sync, drafted each step with draft_batch, finished
    requests evicted by the upkeep (on its thread, or inline). ``wide``: single-byte
    keys with 64 occurrences each, so rows gather more candidates than the insertion
    sort takes (collect_candidates' std::stable_sort)."""
    text = np.frombuffer(TEXT.read_bytes(), dtype=np.uint8).astype(np.int32)
    cfg = index_config(ngram=ngram, max_match=32, max_occurrences=occurrences, max_candidates=candidates,
                       corpus_bytes=90_000)
    ref, nat = _pair(cfg, upkeep_thread)
    rng = np.random.default_rng(0)
    table = np.zeros((8, 1024), np.int32)
    running: dict[int, list[int]] = {}  # sid -> [row, start, prompt_len, length]
    next_sid, free_rows = 0, list(range(8))
    for step in range(250):
        while free_rows and len(running) < 6:  # admit
            start, plen = int(rng.integers(0, len(text) - 1024)), int(rng.integers(16, 300))
            row = free_rows.pop()
            table[row] = text[start:start + 1024]
            running[next_sid] = [row, start, plen, plen]
            next_sid += 1
        for state in running.values():
            state[3] += int(rng.integers(1, 4))
        sids = list(running)
        rows, lengths, plens = ([running[s][i] for s in sids] for i in (0, 3, 2))
        ref.sync(sids, rows, table, lengths, plens)
        nat.sync(np.array(sids), np.array(rows), table, np.array(lengths), np.array(plens))
        budgets = [int(b) for b in rng.integers(1, 9, len(sids))]
        tree = step % 2 == 1
        _assert_same_batch(ref.draft_batch(sids, budgets, 0.02, tree), nat.draft_batch(sids, budgets, 0.02, tree))
        for s in sids:
            if running[s][3] - running[s][2] > 60 or rng.random() < 0.02:
                free_rows.append(running.pop(s)[0])
                ref.finish(s)
                nat.finish(s)
        _assert_same_state(ref, nat, range(next_sid), settle=step % 25 == 0)
    assert ref.corpus_tokens() > 0 and ref.num_sequences() < next_sid  # eviction happened


def test_worked_example():
    nat = native.make_draft_index(index_config(ngram=2))
    nat.add(0, [1, 2, 3, 4, 9, 1, 2], 7)
    assert nat.draft(0, 3) == ([3, 4, 9], [-1, 0, 1], [2 / 3, (2 / 3) ** 2, (2 / 3) ** 2 * (2 / 3)])


def test_match_stops_at_the_text_start():
    """A corpus occurrence at output position 3 of ``7 5 7 8`` against the
    two-token text ``5 7``: the match is 2 (the text has no token before
    ``5``), not 3 from comparing ``7`` with text[-1]."""
    nat = native.make_draft_index(index_config(ngram=1, max_match=8))
    nat.add(1, [7, 5, 7, 8], 0)
    nat.finish(1)
    nat.add(2, [5, 7], 2)
    # candidates: (m=2, corpus pos 3) then (m=1, corpus pos 1); W_root = 3
    assert nat.draft(2, 1) == ([8], [-1], [(2 / 3) * (2 / 3)])


def test_bigrams_with_the_same_hash_tag_stay_apart():
    """(734, 197) and (584, 421) share the native index's 32-bit hash tag;
    lookups compare the tokens themselves, so each keeps its own occurrences."""
    text = [734, 197, 1, 584, 421, 2, 9, 9, 584, 421, 3, 734, 197, 4]
    ref, nat = _pair(index_config(ngram=2, max_match=8))
    for index in (ref, nat):
        index.add(0, text, 0)
        index.finish(0)  # corpus entries
        index.add(1, text + [5, 734, 197], 3)  # own entries, then the corpus
        index.add(2, [584, 421], 0)
    for sid in (1, 2):
        for tree in (False, True):
            assert nat.draft(sid, 6, 0.0, tree) == ref.draft(sid, 6, 0.0, tree)
    assert nat.draft(1, 1)[0] == [4] and nat.draft(2, 1)[0] in ([2], [3])


@pytest.mark.parametrize("field,value", [("ngram", 0), ("ngram", 5), ("max_match", 0), ("max_occurrences", 2000),
                                         ("max_candidates", 0), ("corpus_bytes", -1), ("ngram", True),
                                         ("max_match", 2.0), ("corpus_bytes", 1 << 41)])
def test_bad_config_raises_like_the_reference(field, value):
    args = {"ngram": 3, "max_match": 64, "max_occurrences": 16, "max_candidates": 8, "corpus_bytes": 100}
    args[field] = value
    with pytest.raises(ValueError) as want:
        DraftIndexConfig(**args)
    with pytest.raises(ValueError) as got:
        NativeDraftIndex(**args)
    assert str(got.value) == str(want.value)


def test_max_match_below_ngram():
    with pytest.raises(ValueError, match=r"max_match=2: must be >= ngram \(3\)"):
        NativeDraftIndex(3, 2, 16, 8, 100)


def test_lifecycle_errors():
    nat = native.make_draft_index(index_config())
    nat.add(1, [1, 2, 3], 1)
    with pytest.raises(KeyError):
        nat.add(1, [1], 0)
    with pytest.raises(ValueError, match="prompt_len=4"):
        nat.add(2, [1, 2, 3], 4)
    with pytest.raises(KeyError):
        nat.extend(2, [1])
    with pytest.raises(KeyError):
        nat.rewind(2, 0)
    nat.finish(2)  # unknown: ignored
    nat.finish(1)
    with pytest.raises(KeyError):  # finished, its output still in the corpus
        nat.add(1, [1], 0)
    with pytest.raises(KeyError):
        nat.extend(1, [1])
    assert nat.draft(1, 4) == ([], [], [])
    with pytest.raises(TypeError, match="int32 or int64"):
        nat.sync([3], [0], np.zeros((1, 4), np.float32), [2], [1])
    with pytest.raises(IndexError):
        nat.sync([3], [1], np.zeros((1, 4), np.int32), [2], [1])
    with pytest.raises(ValueError, match="num_tokens"):
        nat.sync([3], [0], np.zeros((1, 4), np.int32), [5], [1])
    live = nat.num_live()
    with pytest.raises(ValueError, match=r"prompt_lens\[1\]=-1: must be >= 0"):  # before row 0 is admitted
        nat.sync([5, 6], [0, 1], np.ones((2, 4), np.int32), [3, 3], [2, -1])
    assert nat.num_live() == live
    with pytest.raises(ValueError, match="outside int32"):
        nat.add(4, [1 << 40], 0)
    for draw in (lambda: nat.draft_batch([3], [1 << 27]), lambda: nat.draft(3, 1 << 27)):  # refused before allocating
        with pytest.raises(ValueError, match=r"budget 134217728: must be at most 65536"):
            draw()


def test_memory_bytes_follows_the_held_tokens():
    nat = native.make_draft_index(index_config(corpus_bytes=0))
    empty = nat.memory_bytes()
    nat.add(0, list(range(4096)), 2048)
    held = nat.memory_bytes()
    assert held > empty + 4096 * 8
    nat.finish(0)  # corpus_bytes=0: its output is evicted at once
    assert nat.num_sequences() == 0 and nat.memory_bytes() < held


def test_make_draft_index_is_native_and_loading_a_missing_build_says_how_to_build(monkeypatch):
    cfg = index_config(ngram=2)
    assert native.make_draft_index(cfg).native and native.make_draft_index(cfg).config == cfg
    monkeypatch.delattr(lookahead_vllm, "_draft_index")
    monkeypatch.setitem(sys.modules, "lookahead_vllm._draft_index", None)  # as if never built
    with pytest.raises(ImportError, match="pip install -e"):
        native.extension.__wrapped__()


@pytest.mark.parametrize("tree", [False, True])
def test_threaded_batch_equals_one_thread_and_the_reference(tree):
    """A batch large enough for several threads (32+ rows each) drafts the
    same rows whatever the thread count, equal to the reference."""
    text = np.frombuffer(TEXT.read_bytes(), dtype=np.uint8).astype(np.int32)
    cfg = index_config(ngram=2, max_match=32, max_occurrences=8, max_candidates=6, corpus_bytes=240_000)
    ref, nat = _pair(cfg)
    rng = np.random.default_rng(1)
    for sid in range(40):  # finished outputs in the corpus
        start = int(rng.integers(0, len(text) - 200))
        for index in (ref, nat):
            index.add(1000 + sid, text[start:start + 200].tolist(), 100)
            index.finish(1000 + sid)
    sids = list(range(150))
    for sid in sids:
        start, length = int(rng.integers(0, len(text) - 300)), int(rng.integers(20, 300))
        for index in (ref, nat):
            index.add(sid, text[start:start + length].tolist(), 10)
    for index in (ref, nat):  # nothing pending: every batch below drafts from the same index
        index.settle()
    budgets = [int(b) for b in rng.integers(0, 12, len(sids))]
    want = ref.draft_batch(sids, budgets, 0.01, tree)
    assert (want[3] > 0).sum() > 100  # most rows draft
    for threads in (1, 2, 3, 8):
        _assert_same_batch(want, nat.draft_batch(np.array(sids), np.array(budgets), 0.01, tree, threads))
    with pytest.raises(ValueError, match="threads=0"):
        nat.draft_batch(np.array(sids), np.array(budgets), 0.01, tree, 0)


@pytest.mark.parametrize("tree", [False, True])
def test_grouped_batch_with_backoff_and_partitions_equals_the_reference(tree):
    """A batch of several gather groups (draft_rows walks 16 rows' occurrence
    lists together): rows of three partitions (private ones draft from their
    own text only), unknown and repeated ids, zero budgets, and the back-off
    index for the rows the main one has no candidate for; equal to the
    reference row by row."""
    text = np.frombuffer(TEXT.read_bytes(), dtype=np.uint8).astype(np.int32)
    cfg = index_config(ngram=3, max_match=40, max_occurrences=12, max_candidates=8, corpus_bytes=400_000)
    short = index_config(ngram=2, max_match=40, max_occurrences=12, max_candidates=8, corpus_bytes=400_000)
    (ref, nat), (ref_b, nat_b) = _pair(cfg), _pair(short)
    rng = np.random.default_rng(2)
    partitions = [0, 1, -1]
    for sid in range(60):  # finished outputs of partitions 0 and 1
        start = int(rng.integers(0, len(text) - 300))
        for index in (ref, nat, ref_b, nat_b):
            index.add(1000 + sid, text[start:start + 300].tolist(), 60, partition=sid % 2)
            index.finish(1000 + sid)
    sids = list(range(70))
    for sid in sids:
        start, length = int(rng.integers(0, len(text) - 400)), int(rng.integers(2, 400))
        for index in (ref, nat, ref_b, nat_b):
            index.add(sid, text[start:start + length].tolist(), min(length, 20), partition=partitions[sid % 3])
    for index in (ref, nat, ref_b, nat_b):
        index.settle()
    rows = sids + [5, 5, 9999, 17]  # repeated and unknown ids
    budgets = [int(b) for b in rng.integers(0, 10, len(rows))]
    want = ref.draft_batch(rows, budgets, 0.01, tree, backoff=ref_b)
    assert (want[3] > 0).sum() > 40
    for threads in (1, 3):
        got = nat.draft_batch(np.array(rows), np.array(budgets), 0.01, tree, threads, nat_b)
        _assert_same_batch(want, got)
    # And with no back-off index: rows the main index has no candidate for stay empty.
    _assert_same_batch(ref.draft_batch(rows, budgets, 0.01, tree),
                       nat.draft_batch(np.array(rows), np.array(budgets), 0.01, tree))


def test_load_extension_names_the_core_or_none(monkeypatch):
    """The GPU kit's install check reports the drafting core through ``load_extension``: the
    module where it is built, None (not an ImportError) where it is not."""
    assert native.load_extension() is native.extension()

    def missing():
        raise ImportError("lookahead_vllm._draft_index is not built")

    monkeypatch.setattr(native, "extension", missing)
    assert native.load_extension() is None


def test_token_table_must_be_native_int32_or_int64():
    """sync reads the runner's token table in place: int32 or int64 in this machine's byte order,
    any strides (a column slice too); anything else is refused naming what it must be."""
    from lookahead_vllm.core import native as core_native

    index = core_native.extension().DraftIndex(2, 16, 4, 4, 1 << 20)
    table = np.array([[1, 2, 3, 1, 2, 3, 1, 2]], np.int64)
    assert index.sync([0], [0], table, [8], [2]) == 0
    assert index.sync([1], [0], np.asfortranarray(table.astype(np.int32)), [8], [2]) == 0
    assert index.sync([2], [0], np.hstack([table, table])[:, ::2], [8], [2]) == 0  # every other column
    for bad in (table.astype(table.dtype.newbyteorder()), table.astype(np.float64), table[0]):
        with pytest.raises(TypeError, match="token_ids must be a 2-D int32 or int64 array"):
            index.sync([3], [0], bad, [4], [2])


# N-grams whose 32-bit tags collide (ngram_map.h's ngram_tag, mirrored here): a slot's tag alone
# cannot tell them apart.
COLLIDING = {1: ((44627,), (48959,)), 2: ((46553, 40965), (16635, 7603))}


def _ngram_tag(tokens: tuple[int, ...]) -> int:
    """ngram_map.h's ngram_tag: the tokens packed into two words, mixed (splitmix64's finalizer)."""
    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & (2**64 - 1)
        return x ^ (x >> 31)

    words = [0, 0]
    for i, t in enumerate(tokens):
        words[i // 2] |= (t & 0xFFFFFFFF) << (32 * (i & 1))
    return mix(words[0] ^ mix((words[1] + 0x9E3779B97F4A7C15) & (2**64 - 1))) & 0xFFFFFFFF


@pytest.mark.parametrize("ngram", sorted(COLLIDING))
def test_colliding_tags_keep_their_ngrams_apart(ngram):
    """Two n-grams with the same tag are two keys, in a request's own text and in the corpus: a
    request ending with one drafts nothing that followed the other (the reference keys by the
    tokens themselves). Without this, one in 2**32 n-gram pairs would draft the wrong text."""
    first, second = COLLIDING[ngram]
    assert first != second and _ngram_tag(first) == _ngram_tag(second)
    ref, nat = _pair(index_config(ngram=ngram, max_occurrences=4))
    for ix in (ref, nat):
        assert ix.config.ngram == ngram
        ix.add(0, [9, *first, 5, 6, 7, 8, 9, *second], 1)  # own text: first followed by 5 6 7 8
        ix.add(1, [3], 1)
        ix.extend(1, [*first, 1, 2, 3, 4])  # output: first followed by 1 2 3 4
        ix.finish(1)
        ix.add(2, [8, 8, *second], 3)  # ends with second only
    for sid in (0, 2):
        got = [ix.draft_batch([sid], [4]) for ix in (ref, nat)]
        assert [a.tolist() for a in got[0]] == [a.tolist() for a in got[1]]
        assert got[1][3].tolist() == [0], f"sequence {sid} drafted from a colliding n-gram"
    for ix in (ref, nat):  # the other n-gram's output joins the corpus after the first's
        ix.add(4, [3], 1)
        ix.extend(4, [*second, 5, 5, 5, 5])
        ix.finish(4)
        ix.add(3, [2, *first], 2)  # ends with the first: drafts what followed it, not the second
    got = [ix.draft_batch([3], [4]) for ix in (ref, nat)]
    assert [a.tolist() for a in got[0]] == [a.tolist() for a in got[1]]
    assert got[1][0].tolist() == [[1, 2, 3, 4]]
