"""The native trie against its pure-Python reference (lookahead_lab.reference.trie).

Both get the same random programs (admit, extend, finish, warm texts, prunes
at a small capacity, snapshot tables loaded back) and must answer every
retrieval with the same tree, weights and confidences bit for bit, hold the
same node counts, and write the same snapshot table.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lookahead_vllm.core.drafter import rows_of
from lookahead_lab.reference import merge_rows
from lookahead_lab.reference.trie import NativeHandles, TokenTrie, native_trie
from lookahead_vllm.core import native as core_native
from tests.settings import lookahead_settings


tokens = st.lists(st.integers(0, 5), max_size=20)
programs = st.lists(
    st.tuples(st.sampled_from(["add", "extend", "extend", "finish", "warm", "retrieve", "rows", "prune"]),
              st.integers(0, 3), tokens, st.integers(0, 10), st.sampled_from([0.0, 0.05, 0.3])),
    max_size=40,
)
knobs = st.fixed_dictionaries({
    "branch_length": st.integers(2, 6),
    "trie_capacity": st.sampled_from([64, 96, 4096]),
    "prompt_weight": st.sampled_from([0.0, 1.0, 1e4]),
    "insert_prompt": st.booleans(),
    "min_retrieved_nodes": st.integers(1, 4),
    "context_match": st.integers(0, 3),
})


def pair(draft_shape: str, **kw) -> tuple[TokenTrie, NativeHandles]:
    kw["max_match_length"] = min(kw.get("max_match_length", 3), kw["branch_length"] - 1)
    config = lookahead_settings(decoding_length=8, draft_shape=draft_shape, **kw)
    reference, native = TokenTrie(config), native_trie(config)
    assert isinstance(reference, TokenTrie) and isinstance(native, NativeHandles)
    return reference, native


def tree_fields(tree) -> tuple[tuple, ...]:
    """A tree's tokens, parents, weights and confidences: the reference's DraftTree, or the
    native trie's lists."""
    if isinstance(tree, tuple):
        return tuple(map(tuple, tree))
    return tree.tokens, tree.parents, tree.weights, tree.confidence


def same_trees(a, b) -> None:
    assert tree_fields(a) == tree_fields(b)  # confidences bit for bit


def same_rows(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    lens = a[4]
    assert np.array_equal(lens, b[4])
    for x, y in zip(a[:4], b[:4]):
        for i, n in enumerate(lens):
            assert np.array_equal(x[i, :n], y[i, :n])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=30), min_size=1, max_size=4), programs, knobs,
       st.sampled_from(["one", "hier", "par"]))
def test_native_trie_equals_reference(prompts, program, kw, shape):
    tries = pair(shape, **kw)
    records: list[dict[int, object]] = [{}, {}]
    texts: dict[int, list[int]] = {}
    program = [("add", rid, prompt, 0, 0.0) for rid, prompt in enumerate(prompts)] + program
    for op, rid, toks, budget, floor in program:
        for t, trie in enumerate(tries):
            recs = records[t]
            if op == "add" and rid not in recs:
                recs[rid] = trie.add_request(toks)
            elif op == "extend" and rid in recs:
                trie.extend(recs[rid], toks)
            elif op == "finish" and rid in recs:
                trie.finish_request(recs.pop(rid))
            elif op == "warm":
                trie.insert_output(toks)
            elif op == "prune":
                trie.prune()
        if op == "add":
            texts.setdefault(rid, list(toks))
        elif op == "extend" and rid in texts:
            texts[rid] += toks
        elif op == "finish":
            texts.pop(rid, None)
        if op == "retrieve":
            context = (texts.get(rid) or toks)[-(budget % 4 + 1):]
            got = [trie.retrieve(context, budget, recs.get(rid), min_confidence=floor)
                   for trie, recs in zip(tries, records)]
            same_trees(*got)
        elif op == "rows":  # every live request plus one with no record, one call
            rids = sorted(records[0])
            contexts = [texts.get(r, []) for r in rids] + [toks]
            lens = np.array([len(c) for c in contexts], np.int64)
            padded = np.zeros((len(contexts), max(1, int(lens.max()))), np.int64)
            for i, c in enumerate(contexts):
                padded[i, :len(c)] = c
            budgets = [budget + i % 3 for i in range(len(contexts))]
            got = [trie.retrieve_rows([recs[r] for r in rids] + [None], padded, lens, budgets, floor)
                   for trie, recs in zip(tries, records)]
            same_rows(*got)
            chains = [trie.context_rows([recs[r] for r in rids] + [None], budgets, floor)
                      for trie, recs in zip(tries, records)]
            same_rows(*chains)
            for r in rids:
                assert tries[0].context_length(records[0][r]) == tries[1].context_length(records[1][r])
        assert tries[0].num_nodes == tries[1].num_nodes
        assert tries[0].num_prunes == tries[1].num_prunes
    tables = [trie.output_counts() for trie in tries]
    assert list(tables[0]) == list(tables[1])
    fresh = pair(shape, **kw)
    for trie in fresh:
        trie.load_output_counts(*tables[0])
    assert fresh[0].num_nodes == fresh[1].num_nodes
    assert list(fresh[0].output_counts()) == list(fresh[1].output_counts())
    for rid, text in texts.items():
        same_trees(*(trie.retrieve(text[-3:] or [0], 8) for trie in fresh))


def test_extend_rows_equals_extend_one_by_one():
    table = np.array([[1, 2, 3, 1, 2, 4, 0, 0], [5, 1, 2, 3, 9, 9, 9, 9]], np.int32)
    tables, trees = [], []
    for rows in (True, False):
        for trie in pair("hier", branch_length=4):
            a, b = trie.add_request([1, 2, 3]), trie.add_request([5, 1])
            if rows:
                trie.extend_rows([a, b], table, [0, 1], [3, 2], [6, 8])
            else:
                trie.extend(a, [1, 2, 4])
                trie.extend(b, [2, 3, 9, 9, 9, 9])
            tables.append(list(trie.output_counts()))
            trees.append(trie.retrieve([1, 2], 8, a))
    assert tables[0] == tables[1] == tables[2] == tables[3] and len(tables[0][0]) > 0
    for tree in trees[1:]:
        same_trees(trees[0], tree)
    assert len(tree_fields(trees[0])[0]) > 0


def test_native_errors_name_the_problem():
    _, native = pair("hier", branch_length=4)
    h = native.add_request([1, 2])
    native.finish_request(h)
    native.finish_request(h)  # idempotent, as the reference
    with pytest.raises(ValueError, match="finished"):
        native.extend(h, [3])
    with pytest.raises(KeyError, match="no such running request"):
        native.extend_rows([h], np.zeros((1, 4), np.int32), [0], [0], [2])
    with pytest.raises(ValueError, match="earlier row"):
        native.load_output_counts([0], [1], [1.0])
    with pytest.raises(ValueError, match="shape='tree'"):
        native.retrieve([1], 4, shape="tree")
    with pytest.raises(ValueError, match="context_lens"):
        native.retrieve_rows([None], np.zeros((1, 2), np.int64), np.array([3]), [4], 0.0)
    module = core_native.extension()
    with pytest.raises(ValueError, match=r"branch_length=1: must be an int in \[2, 128\]"):
        module.TokenTrie(1, 1, 1, 4, 64, 1.0, True, 3)
    with pytest.raises(ValueError, match=r"context_match=65: must be an int in \[0, 64\]"):
        module.TokenTrie(4, 3, 1, 4, 64, 1.0, True, 65)


def random_rows(rng: np.random.Generator, count: int, width: int, weight: float) -> tuple[np.ndarray, ...]:
    """Random trees (parents first, repeated tokens so that merges share prefixes) as rows."""
    rows = rows_of(count, width)
    for r in range(count):
        n = int(rng.integers(0, width + 1))
        for j in range(n):
            rows[0][r, j] = rng.integers(0, 3)
            rows[1][r, j] = rng.integers(-1, j) if j else -1
            rows[3][r, j] = float(rng.choice([0.5, rng.random()]))  # ties too
            rows[2][r, j] = weight * rows[3][r, j]
        rows[4][r] = n
    return rows


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.one_of(st.integers(1, 8), st.integers(30, 48)), st.booleans())
def test_native_merge_rows_equals_reference(seed, width, cuts):
    """Rows of up to 8 nodes (merged by scanning the tree) and of 30-48 (past 64 nodes together:
    merged through a hash map), on the reference's ``merge_rows`` and natively."""
    rng = np.random.default_rng(seed)
    count = 4
    lead, trie = random_rows(rng, count, width, 1e18), random_rows(rng, count, width + 2, 3.0)
    pool = random_rows(rng, count, 6, 1.0) if rng.random() < 0.7 else None
    lead_context = rng.random(count) < 0.5
    # Large rows get room for the trie's nodes too: the merge (not the budget) decides what is kept.
    budgets = rng.integers(0, width + 4, count) if width <= 8 else rng.integers(width, 2 * width + 4, count)
    cut = rng.random(count) < 0.5 if cuts else None
    native = merge_rows(lead, lead_context, trie, budgets, cut, True, pool)
    reference = merge_rows(lead, lead_context, trie, budgets, cut, False, pool)
    for a, b in zip(native, reference):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)


slot_ops = st.lists(
    st.tuples(st.sampled_from(["step", "step", "step", "rewind", "finish", "rows"]), st.integers(0, 4),
              st.integers(0, 6), st.integers(0, 8), st.sampled_from([0.0, 0.05])),
    max_size=30,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(0, 4), min_size=40, max_size=40), min_size=5, max_size=5), slot_ops, knobs,
       st.sampled_from(["one", "hier"]))
def test_native_slots_equal_reference(texts, program, kw, shape):
    """The trie's slot API (the engine's per-step calls: ``sync`` admitting, extending and rewinding
    a batch's requests by slot, partitions kept off, ``finish_slot``, ``retrieve_slots``,
    ``context_slots``) natively and in the reference core (lab reference ``_TrieCore``)."""
    from lookahead_lab.reference import extension as reference_extension

    kw["max_match_length"] = min(3, kw["branch_length"] - 1)
    args = (kw["branch_length"], kw["max_match_length"], 1, kw["min_retrieved_nodes"], kw["trie_capacity"],
            kw["prompt_weight"], kw["insert_prompt"], kw["context_match"])
    cores = [reference_extension.TokenTrie(*args), core_native.extension().TokenTrie(*args)]
    table = np.array(texts, np.int32)
    lengths = {}  # slot -> committed tokens (slot s lives in table row s, prompt 6 tokens, partition s % 3 == 2: another)
    rewound = [0, 0]
    for op, slot, grow, budget, floor in program:
        if op in ("step", "rewind"):
            n = lengths.get(slot, 0)
            n = max(1, n - grow) if op == "rewind" and n else min(40, n + grow + 1)
            lengths[slot] = n
            sids = np.array(sorted(lengths), np.int64)
            nums = np.array([lengths[s] for s in sids], np.int64)
            parts = np.where(sids % 3 == 2, 7, 0)
            # Half the steps say how many of each row's last tokens they sampled (re-read where inserted before).
            sampled = np.minimum(nums, (sids + grow) % 3) if grow % 2 else None
            for t, core in enumerate(cores):
                rewound[t] += core.sync(sids, sids, table, nums, np.full(len(sids), 6, np.int64), parts, sampled)
        elif op == "finish":
            lengths.pop(slot, None)
            for core in cores:
                core.finish_slot(slot)
        elif lengths:  # rows: every held slot plus one never synced
            sids = np.array(sorted(lengths) + [99], np.int64)
            ends = np.array([lengths.get(s, 3) for s in sids], np.int64)
            contexts = np.stack([table[min(s, 4), max(0, e - 3):e].tolist() + [0] * (3 - min(e, 3))
                                 for s, e in zip(sids, ends)]).astype(np.int64)
            lens = np.minimum(ends, 3)
            budgets = np.array([budget + i % 3 for i in range(len(sids))], np.int64)
            got = [core.retrieve_slots(sids, contexts, lens, budgets, floor, shape) for core in cores]
            same_rows(got[0][:5], got[1][:5])
            assert np.array_equal(got[0][5], got[1][5])
            assert list(got[1][5]) == [s == 99 or s % 3 != 2 for s in sids]  # kept off: another partition
            same_rows(*(core.context_slots(sids, budgets, floor) for core in cores))
            for s in sids.tolist():
                assert cores[0].slot_context_length(s) == cores[1].slot_context_length(s)
        assert rewound[0] == rewound[1]
        assert cores[0].num_nodes == cores[1].num_nodes and cores[0].num_slots == cores[1].num_slots
        assert cores[0].num_slot_contexts == cores[1].num_slot_contexts
    assert list(cores[0].output_counts()) == list(cores[1].output_counts())


def test_slot_sync_admits_extends_rewinds_and_keeps_partitions_off():
    """The slot API's lifecycle on the native trie: admitted with its prompt, extended with what
    followed, started over (counted) when the row is shorter, kept off in another partition,
    dropped by finish_slot."""
    core = core_native.extension().TokenTrie(4, 3, 1, 4, 4096, 1.0, True, 2)
    table = np.array([[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6, 5, 6]], np.int32)
    assert core.sync([0, 1], [0, 1], table, [4, 4], [3, 4], [0, 3]) == 0
    assert core.num_slots == 2 and core.num_slot_contexts == 1  # slot 1: another partition, kept off
    assert core.slot_context_length(0) == 4 and core.slot_context_length(1) == -1
    assert core.sync([0], [0], table, [7], [3], [0]) == 0 and core.slot_context_length(0) == 7
    rows = core.retrieve_slots([0, 1], np.array([[3, 1, 2], [5, 6, 5]]), np.array([3, 3]), [2, 2], 0.0, "one")
    assert rows[5].tolist() == [1, 0] and rows[4][1] == 0  # kept off: drafts nothing
    assert rows[0][0, :rows[4][0]].tolist() == [3, 1]  # 1 2 is followed by 3 1 in slot 0's text
    assert core.sync([0], [0], table, [5], [3], [0]) == 1  # rewound: started over
    assert core.slot_context_length(0) == 5
    assert core.sync([0], [0], table, [5], [3], [0], [0]) == 0
    assert core.sync([0], [0], table, [5], [3], [0], [2]) == 1  # the same count, its last 2 sampled anew: re-read
    assert core.slot_context_length(0) == 5
    core.finish_slot(0)
    core.finish_slot(0)  # unknown slots are ignored
    assert core.num_slots == 1 and core.num_slot_contexts == 0 and core.slot_context_length(0) == -1
    with pytest.raises(IndexError, match=r"rows\[0\]=2"):
        core.sync([3], [2], table, [4], [2], [0])
    with pytest.raises(ValueError, match=r"num_tokens\[0\]=9"):
        core.sync([3], [0], table, [9], [2], [0])


@pytest.mark.parametrize("native", [True, False])
def test_a_rewound_request_counts_its_tokens_once(native):
    """A request rewound (sync with fewer tokens than it inserted) and extended again over the
    same tokens leaves the trie's output counts as if it had never been rewound: its tokens up to
    the most it inserted were counted the first time; those past it count as usual."""
    from lookahead_lab.reference import extension as reference_extension

    ext = core_native.extension() if native else reference_extension
    table = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]], np.int32)
    straight, rewound = (ext.TokenTrie(4, 3, 1, 4, 4096, 1.0, True, 2) for _ in range(2))
    for n in (5, 9, 12):
        straight.sync([0], [0], table, [n], [3], [0])
    for n, was_rewound in ((5, 0), (9, 0), (6, 1), (8, 0), (4, 1), (12, 0)):
        assert rewound.sync([0], [0], table, [n], [3], [0]) == was_rewound
    assert list(rewound.output_counts()) == list(straight.output_counts())
    assert sum(straight.output_counts()[2]) > 0


def test_memory_estimate_follows_what_the_trie_holds():
    """The trie's memory estimate (kept as it changes, not walked) counts an admitted prompt's
    counts, one entry of 16 bytes on every node of its windows at least (against a twin that
    holds the same windows as output counts), and gives them back when its nodes go."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 2000).tolist()
    core, twin = (core_native.extension().TokenTrie(6, 3, 1, 4, 1 << 16, 1e4, True, 0) for _ in range(2))
    empty = core.memory_bytes()
    handle = core.add_request(prompt)
    twin.insert_output(prompt)
    held = core.memory_bytes()
    assert core.num_nodes == twin.num_nodes > 0 and held - twin.memory_bytes() >= 16 * core.num_nodes
    core.finish_request(handle)  # every node goes (the free list keeps 4 bytes a node slot)
    assert core.num_nodes == 0 and empty < core.memory_bytes() < held
    assert core.memory_bytes() - twin.memory_bytes() < 16 * twin.num_nodes  # the counts are gone


@pytest.mark.parametrize("parents,counts,match", [
    ([-1, 0, 1, 2, 3], [1.0] * 5, "row 4 is 5 nodes deep: must be at most branch_length=4"),
    ([-1, -2], [1.0, 1.0], "earlier row"),
    ([-1, 0], [1.0, float("nan")], "row 1 has nan: must be finite and >= 0"),
    ([-1, 0], [float("inf"), 1.0], "row 0 has inf"),
    ([-1, 0], [1.0, -0.5], "must be finite and >= 0"),
])
def test_a_table_the_trie_could_not_write_is_refused_whole(parents, counts, match):
    """Native and reference refuse the same tables, and change nothing; a table as deep as branch_length loads."""
    for trie in pair("hier", branch_length=4):
        with pytest.raises(ValueError, match=match):
            trie.load_output_counts(parents, [7] * len(parents), counts)
        assert trie.output_counts() == ([], [], [])
        trie.load_output_counts([-1, 0, 1, 2], [7] * 4, [1.0] * 4)
        assert trie.output_counts()[0] == [-1, 0, 1, 2]
