"""Jacobi lookahead: window layout, slide, n-gram pool, merged step plans."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_lab.reference.planner import branch_tree, merged, with_lookahead
from lookahead_vllm.core.calibration import KIND_BRANCH, KIND_CHAIN, KIND_POOL
from lookahead_vllm.core.draft_tree import DraftTree, fill_row, rows_of
from lookahead_lab.reference import merge_rows, row_drafts
from lookahead_vllm.core.jacobi import (
    JacobiWindow,
    NgramPool,
    lookahead_parents,
    output_nodes,
    pool_rows,
)
from lookahead_vllm.core.step_plan import ROLE_LOOKAHEAD, ROLE_VERIFY, StepPlan, walk_tree


def digest_plan(W=5, N=4, G=2):
    """x0 = 100; window levels 0..N-2 hold tokens 1000*l + i; G pool candidates."""
    rows = [[i for i in range(1, W)]] + [[1000 * l + i for i in range(W)] for l in range(1, N - 1)]
    window = JacobiWindow(W, N, rows)
    cands = [tuple(200 + 10 * g + j for j in range(N - 1)) for g in range(G)]
    verify = merged(DraftTree.empty(), branch_tree(cands), G * (N - 1))
    tree, flags = with_lookahead(verify, window)
    return StepPlan(tree, flags), cands


def test_layout_matches_the_digest_table_w5_n4_g2():
    W, N, G = 5, 4, 2
    plan, cands = digest_plan(W, N, G)
    # (W + G)(N - 1) rows per step: 1 input + 14 lookahead + 6 verification.
    assert plan.num_nodes + 1 == (W + G) * (N - 1) == 21
    assert sum(plan.lookahead) == 14 and plan.lookahead.count(False) == 6
    pos = plan.position_offsets()
    vis = plan.visibility()
    tokens = (None, *plan.tree.tokens)  # row r -> token (row 0 is x0)
    row_of = {t: r for r, t in enumerate(tokens) if r}

    def rows(*toks):
        return {0} | {row_of[t] for t in toks}

    # Lookahead level 0: (0,i) at p+i sees x0 and (0,1..i).
    for i in range(1, W):
        r = row_of[i]
        assert pos[r] == i
        assert set(np.flatnonzero(vis[r])) == rows(*range(1, i + 1))
    # Level l >= 1: (l,i) at p+l+i sees x0, (0,1..i) and (1..l, i).
    for l in range(1, N - 1):
        for i in range(W):
            r = row_of[1000 * l + i]
            assert pos[r] == l + i
            own = [1000 * m + i for m in range(1, l + 1)]
            assert set(np.flatnonzero(vis[r])) == rows(*range(1, i + 1), *own)
    # Verification candidate g: g_j at p+j sees x0 and its own earlier tokens.
    for cand in cands:
        for j, t in enumerate(cand, start=1):
            r = row_of[t]
            assert pos[r] == j
            assert set(np.flatnonzero(vis[r])) == rows(*cand[:j])
    # The two branches never see each other.
    look = [r for r in range(1, 21) if plan.role(r - 1) == ROLE_LOOKAHEAD]
    ver = [r for r in range(1, 21) if plan.role(r - 1) == ROLE_VERIFY]
    assert not vis[np.ix_(look, ver)].any() and not vis[np.ix_(ver, look)].any()
    # The new token of column i comes from (N-2, i).
    assert [tokens[n + 1 + 6] for n in output_nodes(W, N)] == [2000 + i for i in range(W)]


def test_walk_never_accepts_lookahead_nodes():
    plan, cands = digest_plan()
    # The target agrees with lookahead node (0,1) = token 1 at x0: not accepted.
    out = walk_tree(plan, lambda row: 1)
    assert out == ([], [1])
    # It agrees with candidate 1 all the way: accepted, plus the bonus.
    by_row = {0: cands[1][0]}
    by_row.update({1 + plan.tree.tokens.index(t): nxt for t, nxt in zip(cands[1], cands[1][1:])})
    nodes, toks = walk_tree(plan, lambda row: by_row.get(row, 7))
    assert toks == [*cands[1], 7] and all(not plan.lookahead[n] for n in nodes)
    assert not plan.is_chain()


def test_window_update_reads_column_ngrams_and_slides():
    W, N = 4, 3
    win = JacobiWindow(W, N, [[1, 2, 3], [10, 11, 12, 13]])
    grams = win.update(x0=0, new=[20, 21, 22, 23])
    assert grams == [(0, 10, 20), (1, 11, 21), (2, 12, 22), (3, 13, 23)]
    assert win.rows == [[11, 12, 13], [20, 21, 22, 23]]
    # N = 2 is plain Jacobi: the window is level 0 only; its new tokens come
    # from x0 and the level-0 nodes themselves.
    jac = JacobiWindow(3, 2, [[5, 6]])
    assert output_nodes(3, 2) == [-1, 0, 1]
    assert jac.update(x0=4, new=[7, 8, 9]) == [(4, 7), (5, 8), (6, 9)]
    assert jac.rows == [[8, 9]]
    with pytest.raises(ValueError, match="3 new tokens for a window of 4 columns"):
        win.update(0, [1, 2, 3])


def test_window_from_prompt_is_deterministic():
    a = JacobiWindow.from_prompt([5, 6, 7, 8], 5, 4, seed=3)
    b = JacobiWindow.from_prompt([5, 6, 7, 8], 5, 4, seed=3)
    assert a.rows == b.rows and [len(r) for r in a.rows] == [4, 5, 5]
    assert {t for r in a.rows for t in r} <= {5, 6, 7, 8}
    assert a.num_nodes == len(a.tokens()) == 14


def test_pool_is_lru_per_key():
    pool = NgramPool(n=3, max_per_key=2)
    pool.add((1, 2, 3))
    pool.add((1, 4, 5))
    pool.add((1, 2, 3))  # seen again: most recent
    pool.add((1, 6, 7))  # evicts (4, 5), the least recently seen
    assert pool.get(1) == [(6, 7), (2, 3)]
    assert pool.get(1, limit=1) == [(6, 7)] and pool.get(9) == []
    assert len(pool) == 2 and pool.num_added == 4
    with pytest.raises(ValueError, match="holds 3-grams"):
        pool.add((1, 2))


@pytest.mark.parametrize("length", [1, 2, 3])
def test_pool_rows_equal_each_rows_branch_tree(length):
    """pool_rows builds every row's branches in one set of arrays: the same
    cells, row by row, as branch_tree written with fill_row (rows without a
    branch empty; past a row's length the rows_of defaults)."""
    rng = np.random.default_rng(length)
    found = [[tuple(int(t) for t in rng.integers(0, 50, length)) for _ in range(int(rng.integers(0, 5)))]
             for _ in range(9)] + [[]]
    got = pool_rows(found, length)
    want = rows_of(len(found), got[0].shape[1])
    for d, branches in enumerate(found):
        fill_row(want, d, branch_tree(branches))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)
    assert pool_rows([[], []], length)[4].tolist() == [0, 0]


def test_window_parents_after_a_tree_are_shifted_by_its_length():
    tree = DraftTree((7, 8, 9), (-1, 0, -1), (3.0, 2.0, 1.0), (0.9, 0.8, 0.3))
    window = JacobiWindow(3, 3, [[1, 2], [3, 4, 5]])
    combined, flags = with_lookahead(tree, window)
    assert combined.parents == (-1, 0, -1) + tuple(p if p < 0 else p + 3 for p in lookahead_parents(3, 3))
    assert combined.confidence == (0.9, 0.8, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert combined.tokens == (7, 8, 9, 1, 2, 3, 4, 5) and flags == (False,) * 3 + (True,) * 5
    bare = with_lookahead(DraftTree((7,), (-1,), (1.0,)), window)[0]  # no confidences: 1.0 each
    assert bare.confidence == (1.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("native", [False, True])
def test_pool_branches_merge_into_the_trie_tree(native):
    trie_tree = DraftTree((5, 6, 7), (-1, 0, -1), (3.0, 2.0, 1.0), (0.9, 0.8, 0.1))
    rows = [rows_of(1, 5) for _ in range(3)]
    fill_row(rows[1], 0, trie_tree)
    fill_row(rows[2], 0, branch_tree([(5, 6, 9), (8, 1)]))
    out = merge_rows(rows[0], np.zeros(1, bool), rows[1], np.array([5]), None, native, rows[2])
    ((merged, kinds),) = row_drafts(out)
    assert merged.tokens[:3] == (5, 6, 7) and merged.confidence[:3] == (0.9, 0.8, 0.1)
    # (5, 6) shared; 9 hangs under 6; (8, 1) is cut by the budget after 8.
    assert merged.tokens[3:] == (9, 8) and merged.parents[3:] == (1, -1)
    assert merged.confidence[3:] == (0.125, 0.5)
    assert kinds == [KIND_CHAIN, KIND_CHAIN, KIND_BRANCH, KIND_POOL, KIND_POOL]


def test_window_goes_out_while_it_pays_and_is_probed_when_not():
    from lookahead_vllm.core.jacobi import PROBE_EVERY, YIELD_PRIOR, JacobiRequest

    jac = JacobiRequest.from_prompt([1, 2, 3], 4, 3, 2)
    assert jac.yield_est == YIELD_PRIOR and jac.wants_window(0.5)
    for _ in range(20):  # the pool never helps: the estimate decays
        jac.credit(0)
    assert jac.yield_est < 0.01
    sent = [jac.wants_window(0.5) for _ in range(2 * PROBE_EVERY + 2)]
    # Off, except one probe after every PROBE_EVERY steps without it.
    assert sum(sent) == 2 and sent[PROBE_EVERY] and sent[2 * PROBE_EVERY + 1]
    for _ in range(20):  # it pays again (1 token per step): back on
        jac.credit(1)
    assert jac.wants_window(0.5) and jac.wants_window(0.9)


def test_fruitless_probes_back_off_and_a_productive_one_resets():
    from lookahead_vllm.core.jacobi import MAX_PROBE_EVERY, PROBE_EVERY, JacobiRequest

    jac = JacobiRequest.from_prompt([1, 2, 3], 4, 3, 2)
    for _ in range(20):
        jac.credit(0)

    def steps_to_next_probe() -> int:
        n = 1
        while not jac.wants_window(0.5):
            n += 1
        return n

    gaps = []
    for _ in range(6):
        gaps.append(steps_to_next_probe())
        jac.credit(0)  # the probe's step accepted nothing from the pool
    assert gaps == [PROBE_EVERY + 1, 2 * PROBE_EVERY + 1, 4 * PROBE_EVERY + 1, 8 * PROBE_EVERY + 1,
                    MAX_PROBE_EVERY + 1, MAX_PROBE_EVERY + 1]
    steps_to_next_probe()
    jac.credit(2)  # a probe that pays off: back to the short wait
    assert jac.probe_every == PROBE_EVERY
    # A window sent because it pays never lengthens the wait, even if it brings nothing once.
    jac.yield_est = 1.0
    assert jac.wants_window(0.5) and not jac.probing
    jac.credit(0)
    assert jac.probe_every == PROBE_EVERY


def test_request_policy_can_start_from_a_learned_prior():
    from lookahead_vllm.core.jacobi import PROBE_EVERY, YIELD_PRIOR, JacobiRequest

    fresh = JacobiRequest.from_prompt([1, 2, 3], 4, 3, 2)
    assert (fresh.yield_est, fresh.probe_every) == (YIELD_PRIOR, PROBE_EVERY)
    seasoned = JacobiRequest.from_prompt([1, 2, 3], 4, 3, 2, yield_est=0.01, probe_every=4 * PROBE_EVERY)
    assert seasoned.window.rows == fresh.window.rows  # the window itself only depends on the prompt
    assert not any(seasoned.wants_window(0.5) for _ in range(2 * PROBE_EVERY))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_choose_windows_equals_asking_each_window_in_turn(data):
    """The step's windows priced together send the same windows, in the same order, as
    asking each one (``wants_window``) in turn, and leave the same probe bookkeeping and
    the same step, bit for bit."""
    import copy

    from lookahead_lab.reference.planner import choose_windows as choose_windows_reference
    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_vllm.core.jacobi import JacobiRequest, WindowStep, choose_windows

    n = data.draw(st.integers(0, 40))
    shape = data.draw(st.sampled_from([(3, 3), (4, 3), (5, 4)]))
    windows = []
    for i in range(n):
        jac = JacobiRequest.from_prompt([i, i + 1], *shape, 2)
        jac.yield_est = data.draw(st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5]) | st.floats(0.0, 3.0))
        jac.probe_every = data.draw(st.sampled_from([2, 4, 32]))
        jac.steps_without = data.draw(st.integers(0, 5))
        jac.probing = data.draw(st.booleans())
        windows.append(jac)
    fees = np.array([data.draw(st.sampled_from([0.0, 0.01]) | st.floats(0.0, 0.3)) for _ in range(n)])
    cost = ForwardCost(data.draw(st.sampled_from([0, 4, 16, 64])), data.draw(st.sampled_from([4.0, 20.0, 64.0])),
                       data.draw(st.sampled_from([0.0, 0.05])), data.draw(st.sampled_from([0.0, 0.1])))
    step = WindowStep(data.draw(st.integers(1, 64)), data.draw(st.integers(0, 3)),
                      data.draw(st.sampled_from([0.0, 0.04])), data.draw(st.sampled_from([0.0, 0.3])),
                      data.draw(st.floats(1.0, 80.0)))
    ref_windows, ref_step = copy.deepcopy(windows), copy.deepcopy(step)
    sent = choose_windows(windows, fees, step, cost)
    assert sent == choose_windows_reference(ref_windows, fees, ref_step, cost)
    assert step == ref_step
    assert ([(w.steps_without, w.probing) for w in windows]
            == [(w.steps_without, w.probing) for w in ref_windows])


def test_step_drafts_plans_equal_each_offer_with_its_window():
    """``StepDrafts.plan`` builds a window row's plan from the offers' arrays and the window's
    tokens as ``with_lookahead`` does from the offer's tree (tree, weights, confidences, flags);
    a row without a window gets the offer's own plan, a request without a row none."""
    from lookahead_vllm.core.tree_plan import StepDrafts, TreeOffers

    rng = np.random.default_rng(3)
    count, width = 6, 9
    lengths = np.array([0, 1, 4, 9, 2, 7])
    parents = np.full((count, width), -1, np.int32)
    for d, n in enumerate(lengths):
        parents[d, :n] = [rng.integers(-1, i) for i in range(n)]
    offers = TreeOffers(np.arange(count), rng.integers(0, 500, (count, width)).astype(np.int32), parents,
                        rng.random((count, width)), np.zeros((count, width), np.int8), lengths,
                        np.ones(count, bool))
    for shape in ((3, 3), (4, 4), (5, 2)):
        ds = [5, 0, 3, 1]
        windows = {d: JacobiWindow.from_prompt([d, 7, 8], *shape, seed=d) for d in ds}
        handed = StepDrafts(offers, {f"r{d}": d for d in [*ds, 2]},
                            {d: tuple(w.tokens()) for d, w in windows.items()}, *shape)
        for d, w in windows.items():
            plan = handed.plan(f"r{d}")
            assert plan == StepPlan(*with_lookahead(offers.tree(d), w))
            assert plan.num_nodes == int(lengths[d]) + w.num_nodes
        assert handed.plan("r2") == offers.plan(2) and not handed.plan("r2").has_lookahead
        assert handed.plan("r4") is None and set(handed.plans()) == {"r5", "r0", "r3", "r1", "r2"}