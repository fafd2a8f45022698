"""TokenTrie: insertion counts, elimination, pruning, retrieval (unit + properties)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lookahead_lab.reference.planner import best_chain
from lookahead_lab.reference.trie import TokenTrie
from lookahead_lab.reference.trie import TrieRecord, _iter_nodes
from tests.settings import lookahead_settings


def make(**kw) -> TokenTrie:
    base = dict(branch_length=4, max_match_length=2, decoding_length=8)
    base.update(kw)
    return TokenTrie(lookahead_settings(**base))


def path_counts(trie: TokenTrie) -> dict[tuple[int, ...], tuple[int, float]]:
    """{path: (prompt total, output count)} for every node."""
    out = {}
    stack = [((), trie.root)]
    while stack:
        prefix, node = stack.pop()
        for tok, child in node.children.items():
            path = prefix + (tok,)
            out[path] = (child.ptotal, child.out)
            stack.append((path, child))
    return out


def window_counts(seqs: list[list[int]], lb: int) -> Counter:
    """Expected count of each path: number of windows seq[i:i+lb] passing through it."""
    c: Counter = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            w = seq[i:i + lb]
            for d in range(1, len(w) + 1):
                c[tuple(w[:d])] += 1
    return c


def test_prompt_windows_counted():
    trie = make()
    trie.add_request([1, 2, 3, 1, 2, 4])
    counts = path_counts(trie)
    assert counts[(1, 2)] == (2, 0.0)
    assert counts[(1, 2, 3, 1)] == (1, 0.0)
    assert counts[(2, 4)] == (1, 0.0)
    assert (1, 2, 3, 1, 2) not in counts  # window is 4 tokens
    assert trie.num_nodes == len(counts)


def test_output_insertion_equals_window_counts():
    trie = make(branch_length=3)
    a = trie.add_request([])
    trie.extend(a, [5, 6, 7])
    trie.extend(a, [5, 6, 8])
    expected = window_counts([[5, 6, 7, 5, 6, 8]], 3)
    got = {p: o for p, (_, o) in path_counts(trie).items()}
    assert got == {p: float(c) for p, c in expected.items()}


def test_output_windows_continue_from_prompt_tail():
    trie = make(branch_length=3)
    a = trie.add_request([1, 2])
    trie.extend(a, [3])
    counts = path_counts(trie)
    assert counts[(1, 2, 3)] == (0, 1.0)  # window started in the prompt
    assert counts[(2, 3)] == (0, 1.0)
    assert counts[(3,)] == (0, 1.0)


def test_retrieve_prefers_own_prompt_and_longest_match():
    trie = make(branch_length=5, max_match_length=2, min_retrieved_nodes=1)
    mine = trie.add_request([7, 1, 2, 3, 4])
    other = trie.add_request([8, 1, 2, 9, 9, 1, 2, 9, 9])
    tree = trie.retrieve([7, 1, 2], request=mine, shape="one")
    assert list(tree.tokens) == [3, 4]  # matched (1, 2): own prompt outweighs other
    tree = trie.retrieve([8, 1, 2], request=other, shape="one")
    assert list(tree.tokens)[:2] == [9, 9]


def test_retrieve_shortens_match_when_too_few_nodes():
    prompt = [5, 3, 9, 1, 3, 4, 6, 7, 8]
    # "5 3" continues only with 9 1 3 (3 nodes within the 5-token window);
    # "3" alone continues with 9 1 3 4 or 4 6 7 8 (tie -> smaller token first).
    loose = make(branch_length=5, max_match_length=2, min_retrieved_nodes=3)
    a = loose.add_request(prompt)
    assert loose.retrieve([5, 3], request=a, shape="one").tokens == (9, 1, 3)
    strict = make(branch_length=5, max_match_length=2, min_retrieved_nodes=4)
    a = strict.add_request(prompt)
    assert strict.retrieve([5, 3], request=a, shape="one").tokens == (4, 6, 7, 8)


def test_hier_tree_merges_prefixes_and_par_does_not():
    trie = make(branch_length=4, max_match_length=1, decoding_length=6, min_retrieved_nodes=1)
    a = trie.add_request([0, 10, 11, 12, 0, 10, 11, 13, 0, 10, 14, 15])
    hier = trie.retrieve([0], request=a, shape="hier")
    assert hier.tokens[0] == 10 and hier.parents[0] == -1
    assert hier.tokens.count(10) == 1  # shared prefix merged
    par = trie.retrieve([0], request=a, shape="par")
    assert par.tokens.count(10) >= 2  # each branch repeats the shared prefix
    assert len(hier) <= 6 and len(par) <= 6


def test_finish_eliminates_prompt_counts():
    trie = make()
    a = trie.add_request([1, 2, 3])
    before = path_counts(trie)
    b = trie.add_request([1, 2, 3, 4, 5])
    trie.finish_request(b)
    assert path_counts(trie) == before
    trie.finish_request(b)  # idempotent
    trie.finish_request(a)
    assert trie.num_nodes == 0


def test_a_finished_request_cannot_grow_and_loses_its_prompt_weight():
    trie = make()
    a = trie.add_request([1])
    trie.finish_request(a)
    with pytest.raises(ValueError, match="finished"):
        trie.extend(a, [2])
    assert trie.num_nodes == 0 and len(trie.retrieve([1], request=a)) == 0


def test_prune_respects_capacity_and_keeps_active_prompt_when_possible():
    trie = make(branch_length=4, trie_capacity=64)
    a = trie.add_request([1, 2, 3, 4])
    trie.insert_output(list(range(100, 400)))
    assert trie.num_nodes <= 64
    assert trie.num_prunes >= 1
    assert trie.retrieve([1, 2], request=a, shape="one").tokens[:2] == (3, 4)


def test_min_draft_confidence_cuts_uncertain_continuations():
    text = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4]
    loose = make(branch_length=6, max_match_length=1)
    strict = make(branch_length=6, max_match_length=1, min_draft_confidence=0.5)
    for trie in (loose, strict):
        trie.insert_output(text)
    # after "2": "3" seen 3 times (P ~ 3/4), then "4" 2 of 3 (P ~ 2/4): cumulative ~0.375
    assert loose.retrieve([2], shape="one").tokens[:2] == (3, 4)
    assert strict.retrieve([2], shape="one").tokens == (3,)
    assert strict.retrieve([2], shape="hier").tokens == (3,)


def test_budget_zero_and_empty_context():
    trie = make()
    a = trie.add_request([1, 2, 3])
    assert len(trie.retrieve([1], budget=0, request=a)) == 0
    assert len(trie.retrieve([], request=a)) == 0
    assert len(trie.retrieve([99], request=a)) == 0


# ------------------------------------------------------------------ properties
tokens = st.lists(st.integers(0, 6), max_size=24)
ops = st.lists(
    st.tuples(st.sampled_from(["add", "extend", "finish"]), st.integers(0, 3), tokens),
    max_size=25,
)


def _run(trie: TokenTrie, program) -> tuple[dict[int, list[int]], dict[int, TrieRecord]]:
    """Apply a random program; return the live requests' prompts and records."""
    prompts: dict[int, list[int]] = {}
    records: dict[int, TrieRecord] = {}
    for op, rid, toks in program:
        if op == "add" and rid not in prompts:
            records[rid] = trie.add_request(toks)
            prompts[rid] = toks
        elif op == "extend" and rid in prompts:
            trie.extend(records[rid], toks)
        elif op == "finish" and rid in records:
            trie.finish_request(records[rid])  # a second finish does nothing
            prompts.pop(rid, None)
    return prompts, {rid: records[rid] for rid in prompts}


def _check_structure(trie: TokenTrie) -> None:
    nodes = list(_iter_nodes(trie.root))
    assert trie.num_nodes == len(nodes)
    for n in nodes:
        assert n.alive
        assert n.ptotal == sum((n.prompt or {}).values())
        assert n.parent.children[n.token] is n


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_prompt_counts_equal_live_prompt_windows(program):
    trie = make(trie_capacity=1 << 20)  # no pruning: counts are exact
    prompts, _ = _run(trie, program)
    _check_structure(trie)
    expected = window_counts(list(prompts.values()), trie.knobs.branch_length)
    got = {p: c for p, (c, _) in path_counts(trie).items() if c}
    assert got == dict(expected)


@settings(max_examples=100, deadline=None)
@given(ops, tokens)
def test_elimination_restores_prompt_counts(program, extra_prompt):
    trie = make(trie_capacity=1 << 20)
    _run(trie, program)
    before = {p: c for p, (c, _) in path_counts(trie).items()}
    new = trie.add_request(extra_prompt)
    trie.finish_request(new)
    after = {p: c for p, (c, _) in path_counts(trie).items()}
    assert {p: c for p, c in after.items() if c} == {p: c for p, c in before.items() if c}


@settings(max_examples=100, deadline=None)
@given(ops, st.integers(64, 96))
def test_capacity_never_exceeded(program, capacity):
    trie = make(trie_capacity=capacity)
    big = [(op, rid, toks * 4) for op, rid, toks in program]
    _run(trie, big)
    _check_structure(trie)
    assert trie.num_nodes <= capacity


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(1, 12), st.sampled_from(["hier", "par", "one"]))
# A shorter match's branch merged under a longer match's node once kept its own, higher, path
# confidence (0.4 under 0.25): merged nodes are capped at their parent's.
@example(program=[("add", 0, [0, 1, 1, 1, 1, 1])], context=[0, 1], budget=3, shape="hier")
def test_retrieved_paths_exist_and_budget_honoured(program, context, budget, shape):
    trie = make(max_match_length=3, trie_capacity=1 << 20)
    _, records = _run(trie, program)
    record = next(iter(records.values()), None)
    tree = trie.retrieve(context, budget=budget, request=record, shape=shape)
    assert len(tree) <= budget
    depths = tree.depths
    assert all(d <= trie.knobs.branch_length - 1 for d in depths)
    counts = path_counts(trie)
    for node in range(len(tree)):
        branch = tuple(tree.tokens[j] for j in tree.path_to(node))
        # some matched suffix of the context continues with this branch in the trie
        assert any(
            tuple(context[len(context) - m:]) + branch in counts
            for m in range(1, min(len(context), trie.knobs.max_match_length) + 1)
        ), (context, branch)
    if shape == "one":
        assert list(tree.parents) == list(range(-1, len(tree) - 1))
    for i, p in enumerate(tree.parents):
        assert tree.node_confidence(i) > 0  # never draft a token without evidence
        if p >= 0:
            assert tree.node_confidence(i) <= tree.node_confidence(p)


@settings(max_examples=100, deadline=None)
@given(ops, st.lists(st.integers(0, 6), min_size=1, max_size=4), st.floats(0.0, 0.9))
def test_confidence_floor_respected(program, context, floor):
    trie = make(max_match_length=3, trie_capacity=1 << 20)
    _, records = _run(trie, program)
    record = next(iter(records.values()), None)
    for shape in ("one", "hier", "par"):
        tree = trie.retrieve(context, budget=8, request=record, shape=shape, min_confidence=floor)
        assert all(tree.node_confidence(i) >= floor for i in range(len(tree)))


def test_tree_adds_shorter_matches_branches_chain_keeps_the_longest():
    trie = make(min_draft_confidence=0.0)
    trie.insert_output([1, 2, 3, 4])  # "1 2" -> 3 4
    trie.insert_output([9, 2, 7, 8])  # "2" alone -> 3 4 or 7 8
    chain = trie.retrieve([1, 2], shape="one")
    assert chain.tokens == (3, 4)  # the longest match's only branch
    tree = trie.retrieve([1, 2], shape="hier")
    # The "1 2" match's branch first, then "2"'s other branch below it, shared prefix (3 4) merged.
    assert tree.tokens == (3, 4, 7, 8) and tree.parents == (-1, 0, -1, 2)
    assert best_chain(tree) == [3, 4]
    assert len(trie.retrieve([1, 2], shape="hier", budget=3)) == 3
