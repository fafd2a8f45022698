"""Jacobi lookahead: window layout, slide, n-gram pool, merged step plans, and the native
Jacobi table held to its reference (``lookahead_lab.reference.jacobi``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_lab.reference.planner import merged
from lookahead_vllm.core.calibration import KIND_BRANCH, KIND_CHAIN, KIND_POOL
from lookahead_vllm.core.drafter import rows_of
from lookahead_lab.reference import merge_rows, row_drafts
from lookahead_lab.reference.jacobi import (JacobiRequest, JacobiTable, JacobiWindow, NgramPool, branch_tree, prompt_seed,
                                           with_lookahead)
from lookahead_vllm.core import native
from lookahead_vllm.core.budget import ForwardCost
from lookahead_vllm.core.jacobi import MAX_PROBE_EVERY, PROBE_EVERY, YIELD_PRIOR, lookahead_parents, output_nodes
from lookahead_lab.reference.trees import (ROLE_LOOKAHEAD, ROLE_VERIFY, DraftTree, StepPlan, fill_row, offer_tree,
                                          step_plan, step_plans, walk_tree)


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
    a = JacobiWindow.from_prompt([5, 6, 7, 8], 5, 4)
    b = JacobiWindow.from_prompt([5, 6, 7, 8], 5, 4)
    assert a.rows == b.rows and [len(r) for r in a.rows] == [4, 5, 5]
    assert {t for r in a.rows for t in r} == {5, 6, 7, 8}  # 14 draws from 4 tokens: every one drawn here
    assert a.num_nodes == len(a.tokens()) == 14
    assert JacobiWindow.from_prompt([8, 7, 6, 5], 5, 4).rows != a.rows  # another prompt, another fill
    assert JacobiWindow.from_prompt([], 3, 3).tokens() == [0] * 5
    # The native seed is the reference's (FNV-1a over 4 little-endian bytes a token).
    for prompt in ([], [0], [5, 6, 7, 8], [-1, 2**31 - 1, -2**31, 123456]):
        assert native.extension().JacobiTable.prompt_seed(prompt) == prompt_seed(prompt)
    assert prompt_seed([]) == 0xCBF29CE484222325


def test_pool_is_lru_per_key():
    pool = NgramPool(n=3, max_per_key=2)
    pool.add((1, 2, 3))
    pool.add((1, 4, 5))
    pool.add((1, 2, 3))  # seen again: most recent
    pool.add((1, 6, 7))  # evicts (4, 5), the least recently seen
    assert pool.get(1) == [(6, 7), (2, 3)]
    assert pool.get(1, limit=1) == [(6, 7)] and pool.get(9) == []
    assert len(pool) == 2
    with pytest.raises(ValueError, match="holds 3-grams"):
        pool.add((1, 2))


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


def fresh_request(**policy) -> JacobiRequest:
    """A reference record with a window from a fixed prompt and an empty pool."""
    return JacobiRequest(3, JacobiWindow.from_prompt([1, 2, 3], 4, 3), NgramPool(3, 2), **policy)


def test_window_goes_out_while_it_pays_and_is_probed_when_not():
    jac = fresh_request()
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
    jac = fresh_request()
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
    fresh = fresh_request()
    assert (fresh.yield_est, fresh.probe_every) == (YIELD_PRIOR, PROBE_EVERY)
    seasoned = fresh_request(yield_est=0.01, probe_every=4 * PROBE_EVERY)
    assert seasoned.window.rows == fresh.window.rows  # the window itself only depends on the prompt
    assert not any(seasoned.wants_window(0.5) for _ in range(2 * PROBE_EVERY))
    # The native table's defaults are these constants.
    table = native.extension().JacobiTable(4, 3, 2)
    assert table.prior == (YIELD_PRIOR, PROBE_EVERY) == JacobiTable(4, 3, 2).prior


def test_native_table_checks_its_shape_and_arguments():
    make = native.extension().JacobiTable
    with pytest.raises(ValueError, match=r"ngram=1: must be an int in \[2, 16\]"):
        make(4, 1, 2)
    with pytest.raises(ValueError, match=r"window=0: must be an int in \[1, 64\]"):
        make(0, 3, 2)
    table = make(3, 3, 2)
    with pytest.raises(ValueError, match="slots and num_tokens must have the same length"):
        table.track([0, 1], [5])
    with pytest.raises(ValueError, match=r"costs must be a 1-D float array of 2 entries"):
        table.choose([0], [0.0], [1.0], 0.0, 0.0, 1.0)
    with pytest.raises(TypeError, match=r"new_tokens must be a 2-D array \[1, 3\]"):
        table.update([0], np.zeros((1, 2), np.int32), [], [0, 0])
    with pytest.raises(IndexError, match=r"rows\[0\]=3: must be in \[0, 2\)"):
        table.open([0], [3], np.zeros((2, 8), np.int32), [4], [4], [True])
    with pytest.raises(ValueError, match=r"prompt_lens\[0\]=9: must be in \[0, 8\]"):
        table.open([0], [1], np.zeros((2, 8), np.int32), [9], [9], [True])
    with pytest.raises(KeyError, match="slot 9 has no window"):
        table.credit(9, 1)
    for prior, message in (((float("nan"), 32), r"prior yield=nan: must be finite and >= 0"),
                           ((-0.5, 32), r"prior yield=-0.500000: must be finite and >= 0"),
                           ((1.0, 0), r"prior probe_every=0: must be in \[1, 512\]"),
                           ((1.0, 2**40), r"prior probe_every=1099511627776: must be in \[1, 512\]")):
        with pytest.raises(ValueError, match=message):
            table.prior = prior
    assert table.prior == (YIELD_PRIOR, PROBE_EVERY)  # nothing changed
    table.prior = (0.25, 512)
    assert table.prior == (0.25, 512)


SHAPES = [(3, 2, 2), (3, 3, 2), (4, 3, 3), (5, 4, 2), (2, 5, 4)]


class Both:
    """The native table and its reference side by side: each call goes to both and the
    answers must be equal (arrays by value and dtype), the native one is returned."""

    def __init__(self, window: int, ngram: int, guesses: int) -> None:
        self.tables = (native.extension().JacobiTable(window, ngram, guesses), JacobiTable(window, ngram, guesses))

    def __getattr__(self, name: str):
        def call(*args):
            got, want = (getattr(t, name)(*args) for t in self.tables)
            assert _plain(got) == _plain(want), (name, got, want)
            return got
        return call

    @property
    def prior(self):
        got, want = (tuple(t.prior) for t in self.tables)
        assert got == want
        return got

    def set_prior(self, prior: tuple[float, int]) -> None:
        for t in self.tables:
            t.prior = prior

    @property
    def num_slots(self):
        got, want = (t.num_slots for t in self.tables)
        assert got == want
        return got


def _plain(x):
    """Arrays as (dtype, nested lists), tuples and lists alike, for equality."""
    if isinstance(x, np.ndarray):
        return (str(x.dtype), x.tolist())
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_native_table_equals_reference(data):
    """The native Jacobi table and its reference, driven by the same random steps of a batch
    (admissions, growth, rewinds, finishes, windows that open or not, that ride the full
    budget or not, that go out or not, their outputs and credits), answer the same: stale
    rows, pool rows (weights bit for bit), chosen windows and their tokens, n-grams added,
    the prior, and every slot's window, pool and policy after every step."""
    window, ngram, guesses = data.draw(st.sampled_from(SHAPES), label="shape")
    table = Both(window, ngram, guesses)
    # A prior that probes within a few steps reaches the probe path (a window sent though it
    # does not pay, its wait doubled when it brings nothing).
    table.set_prior((data.draw(st.sampled_from([0.0, 0.05, 1.0]), label="prior yield"),
                     data.draw(st.sampled_from([1, 2, 3, PROBE_EVERY]), label="prior probe")))
    vocab = data.draw(st.integers(2, 12), label="vocab")
    width = 64
    token_ids = np.zeros((8, width), np.int32)
    live: dict[int, int] = {}  # slot -> committed tokens
    next_slot = 0
    went_out = 0
    for _ in range(data.draw(st.integers(1, 14), label="steps")):
        while len(live) < data.draw(st.integers(1, 5), label="batch"):
            live[next_slot] = data.draw(st.integers(1, 12), label="prompt")
            next_slot += 1
        for slot in list(live):
            op = data.draw(st.sampled_from(["grow", "grow", "grow", "rewind", "finish"]), label="op")
            if op == "finish":
                table.finish(slot)
                del live[slot]
            elif op == "rewind":
                live[slot] = max(1, live[slot] - data.draw(st.integers(1, 4), label="back"))
            else:
                live[slot] = min(width - 1, live[slot] + data.draw(st.integers(0, 3), label="grow"))
        if not live:
            continue
        slots = np.array(sorted(live), np.int64)
        rows = slots % 8
        for slot, row in zip(slots.tolist(), rows.tolist()):
            token_ids[row] = (np.arange(width) * (slot + 3) + slot) % vocab
        num = np.array([live[s] for s in slots.tolist()], np.int64)
        stale = table.track(slots, num)
        # A request the runner does not know yet is not opened (it stays stale: asked again next step).
        stale = stale[np.array([data.draw(st.integers(0, 5), label="known") > 0 for _ in stale], bool)]
        windowed = np.array([data.draw(st.sampled_from([True, True, False]), label="verifiable") for _ in stale],
                            bool)
        plen = np.array([data.draw(st.integers(1, 12), label="plen") for _ in stale], np.int64)
        table.open(slots[stale], rows[stale], token_ids, np.minimum(num[stale], plen), num[stale], windowed)
        full = np.array([data.draw(st.sampled_from([True, True, False]), label="full") for _ in slots], bool)
        pool, _ = table.pool_rows(slots, token_ids[rows, num - 1], full)
        table.set_pool_from(slots, pool[4] // 2)
        fees = np.array([data.draw(st.sampled_from([0.0, 0.05, 0.4]), label="fee") for _ in slots])
        cost = ForwardCost(data.draw(st.sampled_from([0, 4, 16]), label="free"),
                           data.draw(st.sampled_from([4.0, 20.0]), label="marginal"), 0.05, 0.1)
        m = np.arange(len(slots) + 1)
        extra = data.draw(st.integers(0, 3), label="extra")
        tokens = len(slots) + data.draw(st.integers(0, 20), label="tokens")
        nodes = window * (ngram - 1) - 1
        costs = cost.many(tokens + m * nodes, extra + m * window)
        # The batched prices are the window-by-window ones, bit for bit.
        assert costs.tolist() == [cost(tokens + k * nodes, extra + k * window) for k in m.tolist()]
        chosen, ahead = table.choose(slots, fees, costs, data.draw(st.sampled_from([0.0, 0.04]), label="setup"),
                                     data.draw(st.sampled_from([0.0, 0.3]), label="paid"),
                                     data.draw(st.floats(1.0, 40.0), label="gain"))
        went_out += len(chosen)
        if len(chosen):
            new = np.array([[data.draw(st.integers(0, vocab - 1), label="new") for _ in range(window)]
                            for _ in chosen], np.int32)
            counts = [data.draw(st.integers(0, 4), label="accepted") for _ in chosen]
            accepted = np.array([data.draw(st.integers(0, 8), label="node") for _ in range(sum(counts))], np.int64)
            table.update(slots[chosen], new, accepted, np.cumsum([0, *counts]))
        for slot in slots.tolist():
            if data.draw(st.integers(0, 9), label="credit?") == 0 and table.window_tokens(slot) is not None:
                table.credit(slot, data.draw(st.integers(0, 2), label="credit"))
        assert table.prior and table.num_slots == len({s for s in live if table.policy(s) is not None})
        for slot in slots.tolist():
            table.policy(slot)
            table.pool_size(slot)
            for key in range(vocab):
                table.pool(slot, key)
                table.pool(slot, key, 1)


def test_native_probe_waits_double_up_to_their_cap_as_the_reference():
    """A window that never pays goes out only as a probe; each probe that brings nothing
    doubles the wait up to ``MAX_PROBE_EVERY``: the native table and its reference send the
    same windows on the same steps over the whole climb."""
    table = Both(3, 3, 2)
    table.set_prior((0.0, 100))
    token_ids = np.tile(np.arange(20, dtype=np.int32), (1, 4))
    slots, sent = np.array([0]), []
    table.track(slots, [5])
    table.open(slots, [0], token_ids, [5], [5], [True])
    for n in range(6, 2400):
        table.track(slots, [n])
        table.pool_rows(slots, [7], [True])
        chosen, _ = table.choose(slots, [0.0], [1.0, 1.5], 0.0, 0.0, 1.0)
        if len(chosen):
            sent.append(n)
            table.update(slots, np.zeros((1, 3), np.int32), np.zeros(0, np.int64), [0, 0])  # nothing accepted
    gaps = np.diff(sent).tolist()
    assert gaps == [201, 401] + [MAX_PROBE_EVERY + 1] * 3
    assert table.policy(0)["probe_every"] == MAX_PROBE_EVERY


def test_native_table_program_reaches_every_path():
    """The program above is not vacuous: a fixed run of it sends windows, fills pools and
    offers their branches (checked on the native table alone)."""
    table = native.extension().JacobiTable(3, 3, 2)
    token_ids = np.tile(np.array([1, 2, 3, 1, 2, 4, 1, 2, 3], np.int32), (2, 2))
    slots, rows = np.array([0, 1]), np.array([0, 1])
    assert table.track(slots, [5, 5]).tolist() == [0, 1]
    table.open(slots, rows, token_ids, [5, 5], [5, 5], [True, False])
    assert table.track(slots, [6, 6]).tolist() == [] and table.pool_size(1) == -1
    pool, branches = table.pool_rows(slots, [2, 2], [True, True])
    assert branches == 0 and pool[4].tolist() == [0, 0] and table.policy(0)["x0"] == 2
    chosen, ahead = table.choose(slots, [0.0, 0.0], [1.0, 1.1, 1.2], 0.0, 0.0, 2.0)
    assert chosen.tolist() == [0] and ahead.tolist() == [table.window_tokens(0)]
    assert table.update(slots[chosen], np.array([[7, 8, 9]], np.int32), [], [0, 0]) == 3
    w = ahead[0].tolist()  # level 0: columns 1, 2; level 1: columns 0, 1, 2
    grams = [(2, w[2], 7), (w[0], w[3], 8), (w[1], w[4], 9)]
    want: dict[int, list[tuple[int, int]]] = {}
    for g in grams:  # most recently seen first, at most 2 a key
        conts = want.setdefault(g[0], [])
        if g[1:] in conts:
            conts.remove(g[1:])
        conts.insert(0, g[1:])
        del conts[2:]
    assert {key: table.pool(0, key) for key in want} == want
    assert table.pool_size(0) == sum(map(len, want.values()))
    assert table.window_tokens(0) == [w[3], w[4], 7, 8, 9]  # the slide: level 1 less column 0, the new tokens
    table.track(slots, [7, 7])
    pool, branches = table.pool_rows(slots, [2, 2], [True, True])
    assert branches == len(want[2]) and pool[4].tolist() == [2 * len(want[2]), 0]
    assert pool[0][0, :2].tolist() == list(want[2][0]) and pool[1][0, :2].tolist() == [-1, 0]
    assert pool[2][0, :2].tolist() == [0.5, 0.25]


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
        windows = {d: JacobiWindow.from_prompt([d, 7, 8], *shape) for d in ds}
        handed = StepDrafts(offers, {f"r{d}": d for d in [*ds, 2]},
                            {d: tuple(w.tokens()) for d, w in windows.items()}, *shape)
        for d, w in windows.items():
            plan = step_plan(handed, f"r{d}")
            assert plan == StepPlan(*with_lookahead(offer_tree(offers, d), w))
            assert plan.num_nodes == int(lengths[d]) + w.num_nodes
        assert step_plan(handed, "r2") == StepPlan(offer_tree(offers, 2)) and not step_plan(handed, "r2").has_lookahead
        assert step_plan(handed, "r4") is None and set(step_plans(handed)) == {"r5", "r0", "r3", "r1", "r2"}