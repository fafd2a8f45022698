"""The native tree kernels equal their pure-Python reference (lookahead_lab.reference.planner).

Same inputs through both: each step's offers (best paths where a row may not
verify a tree, kinds, kept prefixes, which rows carry a tree), calibrated
confidences and drafts; the offers walked with what the rows emitted; and the
calibrator's tables after the same bookings (bit for bit, half-life halvings
included). Rows come as the draft index drafts them (kinds derived, best paths cut
here) or with their kinds given (sources merged per request, already cut).
The reference itself composes the pieces (DraftTree, the calibration
rule, allocate_step_budget with opens_path, accepted_path, observe_nodes):
checked here on small cases.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_vllm.core import calibration
from lookahead_vllm.core.budget import ForwardCost
from lookahead_lab.reference.planner import allocate_step_budget, opens_path
from lookahead_lab.reference import ReferenceCalibrator, match, plan_trees
from lookahead_vllm.core import native as core_native
from lookahead_vllm.core.calibration import KIND_BRANCH, KIND_CHAIN, KIND_CONTEXT, KIND_POOL, ConfidenceCalibrator
from lookahead_vllm.core.tree_plan import TreeOffers

# Confidences with ties and bin edges among them.
confidence = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.02, 0.1, 0.5, 0.9, 1.0]))
COSTS = [ForwardCost(0, 1.0), ForwardCost(5, 20.0), ForwardCost(16, 4.0, 0.3, 0.5), ForwardCost(64, 64.0, 0.05, 0.2),
         ForwardCost(1, 33.0, 1.0, 0.0), ForwardCost(8, 8.0, 0.0, 2.0), ForwardCost(5, 20.0, 0.02, 0.09, 0.15),
         ForwardCost(32, 675.0, draft_setup=0.4)]


@st.composite
def step_trees(draw):
    """A step's raw index trees (parents first, siblings with distinct tokens
    as the index drafts them), whether each may verify a tree, batch rows."""
    rows, width = draw(st.integers(0, 10)), draw(st.integers(0, 9))
    tokens = np.zeros((rows, width), np.int32)
    parents = np.full((rows, width), -1, np.int32)
    raw = np.zeros((rows, width))
    lens = np.array([draw(st.integers(0, width)) for _ in range(rows)], np.int32)
    for r in range(rows):
        seen = set()
        for i in range(lens[r]):
            p = draw(st.sampled_from([i - 1] * 3 + list(range(-1, i))))  # chains most often
            t = draw(st.integers(0, 6).filter(lambda t, p=p: (p, t) not in seen))
            seen.add((p, t))
            tokens[r, i], parents[r, i], raw[r, i] = t, p, draw(confidence)
    tree_ok = np.array([draw(st.booleans()) for _ in range(rows)], bool)
    num_out = rows + draw(st.integers(0, 4))
    out_rows = np.array(draw(st.permutations(range(num_out)))[:rows], np.int64)
    slots = np.array(draw(st.lists(st.integers(0, 40), unique=True, min_size=rows, max_size=rows)), np.int64)
    return tokens, parents, raw, lens, tree_ok, slots, out_rows, num_out


def trained_calibrator(history) -> ConfidenceCalibrator:
    """A calibrator whose factors moved away from 1 for both index kinds."""
    calibrator = ReferenceCalibrator(prior=2.0)
    for raw, kind, hits in history:
        calibrator.observe_nodes(np.full(len(raw), kind, np.int64), np.asarray(raw), np.asarray(hits, bool))
    return calibrator


# Past bookings: (raw confidences, kind, accepted flags) per draft.
ALL_KINDS = [KIND_CHAIN, KIND_BRANCH, KIND_POOL, KIND_CONTEXT]
history = st.lists(st.tuples(st.lists(confidence, min_size=1, max_size=8), st.sampled_from(ALL_KINDS),
                             st.lists(st.booleans(), min_size=8, max_size=8)).map(
                                 lambda h: (h[0], h[1], h[2][:len(h[0])])), max_size=6)


@settings(max_examples=400, deadline=None)
@given(step_trees(), history, st.one_of(st.none(), st.integers(0, 30)), st.integers(0, 8), st.sampled_from(COSTS),
       st.one_of(st.none(), st.randoms(use_true_random=False)),
       st.one_of(st.none(), st.lists(st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.8, 2.0]), min_size=10, max_size=10)))
def test_plan_trees_equals_reference(trees, past, budget, extra_rows, cost, given_kinds, fees):
    """Index rows, and rows with their kinds given (``given_kinds``: a
    random source of kinds; such rows are planned as they come, trees where
    tree_ok says no included); with or without rows' entry fees."""
    tokens, parents, raw, lens, tree_ok, slots, out_rows, num_out = trees
    entry = None if fees is None else np.array(fees[:len(lens)])
    calibrator = trained_calibrator(past)
    num_rows = len(lens) + extra_rows
    kinds = None
    if given_kinds is not None:
        kinds = np.array([[given_kinds.choice(ALL_KINDS) for _ in range(tokens.shape[1])] for _ in lens],
                         np.int8).reshape(tokens.shape)
    args = (tokens, parents, raw, lens, tree_ok, calibrator, budget, num_rows, cost, slots, out_rows, num_out)
    want_offers, want_conf, want_drafts = plan_trees(*args, native=False, kinds=kinds, entry=entry)
    got_offers, got_conf, got_drafts = plan_trees(*args, native=True, kinds=kinds, entry=entry)
    if kinds is not None:  # planned as given: every row keeps a prefix of itself, its kinds
        for r, n in enumerate(want_offers.lengths.tolist()):
            assert want_offers.tokens[r, :n].tolist() == tokens[r, :n].tolist()
            assert want_offers.kinds[r, :n].tolist() == kinds[r, :n].tolist()
    assert got_drafts == want_drafts
    for name in ("slots", "lengths", "trees", "tokens", "parents", "raw", "kinds"):
        assert getattr(got_offers, name).tolist() == getattr(want_offers, name).tolist(), name
    assert got_offers.kinds.dtype == np.int8 and got_offers.tokens.dtype == np.int32
    for r in range(len(lens)):
        n = int(want_offers.lengths[r])
        assert got_conf[r, :n].tolist() == want_conf[r, :n].tolist()  # bit for bit
    assert sum(map(len, got_drafts)) <= (sum(lens.tolist()) if budget is None else budget)


def test_plan_trees_worked_example():
    """The module docstring's example: ``a(-1) b(0) c(-1)``, raw 0.8/0.5/0.3."""
    tokens = np.array([[1, 2, 3]], np.int32)
    parents = np.array([[-1, 0, -1]], np.int32)
    raw = np.array([[0.8, 0.5, 0.3]])
    calibrator = ConfidenceCalibrator()
    for budget, kept, tree in ((2, [1, 2], False), (3, [1, 2, 3], True)):
        offers, conf, drafts = plan_trees(tokens, parents, raw, np.array([3], np.int32), np.array([True]), calibrator,
                                          budget, 1, ForwardCost(0, 1.0), np.array([5]), np.array([0]), 1, native=True)
        assert drafts == [kept] and offers.trees.tolist() == [tree]
        assert offers.kinds[0].tolist() == [KIND_CONTEXT, KIND_CONTEXT, KIND_BRANCH]
        assert conf[0].tolist() == [0.8, 0.5, 0.3]
    # A row that may not verify a tree keeps its best path (the heavier child: a, then b).
    offers, _, drafts = plan_trees(tokens, parents, raw, np.array([3], np.int32), np.array([False]), calibrator,
                                   None, 1, ForwardCost(0, 1.0), np.array([5]), np.array([0]), 1, native=True)
    assert drafts == [[1, 2]] and offers.parents[0, :2].tolist() == [-1, 0] and not offers.trees[0]


def test_reference_composes_the_per_request_pieces():
    """Path prices: with a costly extra path the side branch is cut even
    though its confidence would pay as a token (what allocate_step_budget
    decides with opens_path)."""
    tokens = np.array([[1, 2, 3], [4, 5, 0]], np.int32)
    parents = np.array([[-1, 0, -1], [-1, 0, -1]], np.int32)
    raw = np.array([[0.9, 0.8, 0.7], [0.9, 0.6, 0.0]])
    lens = np.array([3, 2], np.int32)
    calibrator = ConfidenceCalibrator()
    keeps = []
    for cost in (ForwardCost(4, 8.0), ForwardCost(4, 8.0, 2.0, 1.0)):
        keeps.append(keep := allocate_step_budget([[0.9, 0.8, 0.7], [0.9, 0.6]], None, 2, cost,
                                    [opens_path([-1, 0, -1]), opens_path([-1, 0])]))
        for native in (False, True):
            offers, _, _ = plan_trees(tokens, parents, raw, lens, np.array([True, True]), calibrator, None, 2, cost,
                                      np.array([0, 1]), np.array([0, 1]), 2, native=native)
            assert offers.lengths.tolist() == keep
    # Free paths: every node pays; a dear path: node 2 (a second path) is cut, and
    # the step's dearer tokens cut row 1's weaker node too.
    assert keeps == [[3, 2], [2, 1]]


@st.composite
def offers_and_rows(draw):
    """Last step's offers (trees), this step's rows: some with an offer, some
    without, some that verified nothing; emitted tokens that follow a path
    of the offer for a while (or not)."""
    tokens, parents, raw, lens, tree_ok, slots, _, _ = draw(step_trees())
    kinds = np.array([[draw(st.sampled_from([KIND_CONTEXT, KIND_BRANCH])) for _ in range(tokens.shape[1])]
                      for _ in range(len(lens))], np.int8).reshape(tokens.shape)
    offers = TreeOffers(slots, tokens, parents, raw, kinds, lens.astype(np.int64), tree_ok)
    rows = draw(st.lists(st.sampled_from(slots.tolist() + [41, 42, 43]), unique=True, max_size=12))
    scheduled, emitted = [], []
    for slot in rows:
        scheduled.append(draw(st.integers(0, 10)))
        where = slots.tolist().index(slot) if slot in slots.tolist() else None
        walk, node = [], -1
        for _ in range(draw(st.integers(0, 6))):  # follow some child while there is one
            kids = [c for c in range(int(lens[where])) if parents[where, c] == node] if where is not None else []
            if not kids or draw(st.booleans()) and draw(st.booleans()):
                break
            node = draw(st.sampled_from(kids))
            walk.append(int(tokens[where, node]))
        emitted.append(walk + [draw(st.integers(0, 6))])
    return offers, np.array(rows, np.int64), np.array(scheduled, np.int64), emitted


@settings(max_examples=300, deadline=None)
@given(offers_and_rows())
def test_match_trees_equals_reference(case):
    offers, slots, scheduled, emitted = case
    want = match(offers, slots, scheduled, emitted, native=False)
    got = offers.match(slots, scheduled, emitted)
    for w, g in zip(want, got):
        assert g.tolist() == w.tolist()
    at, verified, hits = want
    assert ((verified > 0) & (verified <= offers.lengths[at])).all()
    assert all(not hits[d, v:].any() for d, v in zip(at.tolist(), verified.tolist()))


@settings(max_examples=200, deadline=None)
@given(st.lists(offers_and_rows(), min_size=1, max_size=4), st.sampled_from([4, 16, 4096]))
def test_observe_trees_equals_reference(steps, half_life):
    """Tables equal bit for bit after the same bookings (a small half-life
    makes the halving happen), and equal observe_nodes over the same nodes."""
    mp = pytest.MonkeyPatch()
    mp.setattr(calibration, "HALF_LIFE_NODES", half_life)
    try:
        ref, nat = ReferenceCalibrator(prior=2.0), ConfidenceCalibrator(prior=2.0)
        for offers, slots, scheduled, emitted in steps:
            at, verified, hits = match(offers, slots, scheduled, emitted, native=False)
            assert offers.observe(nat, at, verified, hits) == offers.observe(ref, at, verified, hits)
            for name in ("predicted", "accepted", "nodes", "_factor"):
                np.testing.assert_array_equal(getattr(nat, name), getattr(ref, name), err_msg=name)
    finally:
        mp.undo()



@st.composite
def walked_trees(draw):
    """Trees (parents first, siblings with distinct tokens) and a target per row: along a
    path of the tree for a while (the walk goes deep), then anything."""
    tokens, parents, _, lens, *_ = draw(step_trees())
    width = tokens.shape[1]
    targets = np.array([[draw(st.integers(0, 6)) for _ in range(width + 1)]
                        for _ in lens], np.int64).reshape(len(lens), width + 1)
    for d in range(len(lens)):
        node = -1
        while draw(st.booleans()):
            kids = [c for c in range(int(lens[d])) if parents[d, c] == node]
            if not kids:
                break
            child = draw(st.sampled_from(kids))
            targets[d, node + 1] = tokens[d, child]
            node = child
    cut = np.array([draw(st.integers(0, int(n))) for n in lens], np.int64)  # a verified prefix of each
    return tokens, parents, cut, targets


@settings(max_examples=300, deadline=None)
@given(walked_trees())
def test_walk_trees_equals_reference(case):
    """The greedy walks of a step's trees in one call equal ``walk_tree`` tree by tree
    (the nodes accepted, root to leaf, and the bonus), over any verified prefix."""
    from lookahead_lab.reference.planner import walk_trees

    tokens, parents, lens, targets = case
    want = walk_trees(tokens, parents, lens, targets)
    got = core_native.extension().walk_trees(tokens, parents, lens, targets)
    for w, g in zip(want, got):
        assert g.tolist() == w.tolist()
    nodes, counts, _ = want
    assert all((nodes[d, :c] < lens[d]).all() and (nodes[d, c:] == -1).all() for d, c in enumerate(counts))

def test_kernels_reject_bad_input():
    k = core_native.extension()
    edges, factor = ConfidenceCalibrator.bin_edges, np.ones((4, 12))
    tok, raw = np.zeros((1, 2), np.int32), np.zeros((1, 2))
    with pytest.raises(ValueError, match="parents"):  # a parent after its child
        k.plan_trees(tok, np.array([[1, -1]], np.int32), raw, [2], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0,
                     0.0, [0], 1)
    with pytest.raises(ValueError, match="lens"):
        k.plan_trees(tok, np.full((1, 2), -1, np.int32), raw, [3], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0,
                     0.0, [0], 1)
    with pytest.raises(IndexError, match="out_rows"):
        k.plan_trees(tok, np.full((1, 2), -1, np.int32), raw, [1], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0,
                     0.0, [1], 1)
    with pytest.raises(ValueError, match="draft_setup"):
        k.plan_trees(tok, np.full((1, 2), -1, np.int32), raw, [1], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0,
                     -1.0, [0], 1)
    with pytest.raises(ValueError, match="kinds: 4 is not a calibration kind"):
        k.plan_trees(tok, np.full((1, 2), -1, np.int32), raw, [1], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0,
                     0.0, [0], 1, np.full((1, 2), 4, np.int8))
    with pytest.raises(TypeError, match="kinds must be"):
        k.plan_trees(tok, np.full((1, 2), -1, np.int32), raw, [1], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0,
                     0.0, [0], 1, np.zeros((2, 2), np.int8))
    none = np.full((1, 2), -1, np.int32)
    with pytest.raises(ValueError, match="num_out=-1: must be >= 0"):
        k.plan_trees(tok, none, raw, [1], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0, 0.0, [0], -1)
    for at, name in ((11, "per_path"), (12, "path_setup"), (13, "draft_setup")):
        args = [tok, none, raw, [1], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0, 0.0, [0], 1]
        args[at] = float("nan")
        with pytest.raises(ValueError, match=f"{name}=nan: must be finite and >= 0"):
            k.plan_trees(*args)
    with pytest.raises(ValueError, match="marginal_tokens finite"):
        k.plan_trees(tok, none, raw, [1], [True], edges, factor, -1, 1, 4, float("inf"), 0.0, 0.0, 0.0, [0], 1)
    # Integers the kernels' narrow types cannot hold are refused, not wrapped (2**32 - 1 would read as parent -1).
    with pytest.raises(ValueError, match="parents: 4294967295 does not fit 32-bit integers"):
        k.plan_trees(tok, np.array([[2**32 - 1, -1]]), raw, [1], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0,
                     0.0, [0], 1)
    with pytest.raises(ValueError, match="kinds: 257 does not fit 8-bit integers"):  # would wrap to kind 1
        k.plan_trees(tok, none, raw, [1], [True], edges, factor, -1, 1, 0, 1.0, 0.0, 0.0, 0.0, [0], 1,
                     np.full((1, 2), 257))
    with pytest.raises(ValueError, match="tokens: -4294967296 does not fit 32-bit integers"):
        k.walk_trees(np.full((1, 2), -2**32), none, [1], np.zeros((1, 2), np.int64))
    wide = k.walk_trees(np.array([[7, 8]]), np.array([[-1, 0]]), [2], np.array([[7, 8, 9]]))  # int64 that fits
    assert [w.tolist() for w in wide] == [w.tolist() for w in k.walk_trees(
        np.array([[7, 8]], np.int32), np.array([[-1, 0]], np.int32), [2], np.array([[7, 8, 9]]))]
    with pytest.raises(ValueError, match="emitted"):
        k.match_trees([1], [1], tok, np.full((1, 2), -1, np.int32), [1], [1], [[5], [6]])
    with pytest.raises(ValueError, match=r"lens\[0\]=2: a tree of n nodes needs n \+ 1 targets, targets has 2"):
        k.walk_trees(tok, np.full((1, 2), -1, np.int32), [2], np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="parents"):
        k.walk_trees(tok, np.array([[1, -1]], np.int32), [2], np.zeros((1, 3), np.int64))
