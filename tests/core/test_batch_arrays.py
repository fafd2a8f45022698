"""The array forms the proposer's batch path uses equal their per-request references."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_vllm.core.budget import ForwardCost, allocate_chain_budget, allocate_step_budget
from lookahead_vllm.core.calibration import KIND_CONTEXT, ConfidenceCalibrator
from lookahead_vllm.core.draft_tree import DraftTree

confidence = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.1, 0.5, 1.0]))  # ties too


@st.composite
def chains(draw):
    """Rows of non-increasing confidences (as calibration leaves them), zero-padded."""
    rows = draw(st.lists(st.lists(confidence, max_size=8), min_size=1, max_size=8))
    rows = [sorted(r, reverse=True) for r in rows]
    width = max(map(len, rows))
    arr = np.zeros((len(rows), width))
    for i, r in enumerate(rows):
        arr[i, :len(r)] = r
    return rows, arr


@settings(max_examples=300, deadline=None)
@given(chains(), st.one_of(st.none(), st.integers(0, 40)), st.integers(0, 6),
       st.sampled_from([None, ForwardCost(0, 1.0), ForwardCost(5, 20.0), ForwardCost(16, 4.0), ForwardCost(64, 64.0),
                        ForwardCost(5, 20.0, draft_setup=0.05), ForwardCost(2, 8.0, draft_setup=0.5)]))
def test_chain_budget_equals_the_merged_order_allocation(rows_arr, budget, extra_rows, cost):
    rows, arr = rows_arr
    lengths = np.array([len(r) for r in rows])
    num_rows = len(rows) + extra_rows
    want = allocate_step_budget(rows, budget, num_rows, cost)
    assert allocate_chain_budget(arr, lengths, budget, num_rows, cost).tolist() == want


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.lists(confidence, min_size=1, max_size=8), st.integers(0, 8)), min_size=1, max_size=30),
       chains())
def test_chain_calibration_equals_per_tree_calibration(history, probe):
    """After the same evidence (one draft at a time, or all at once), chains
    calibrate as DraftTree.calibrate does."""
    one, batch = ConfidenceCalibrator(prior=2.0), ConfidenceCalibrator(prior=2.0)
    kinds, raws, hits = [], [], []
    for confs, accepted in history:
        tree = DraftTree(tuple(range(len(confs))), tuple(range(-1, len(confs) - 1)), (1.0,) * len(confs),
                         tuple(confs))
        one.observe(tree, [KIND_CONTEXT] * len(confs), list(range(min(accepted, len(confs)))))
        kinds += [KIND_CONTEXT] * len(confs)
        raws += confs
        hits += [i < accepted for i in range(len(confs))]
    batch.observe_nodes(np.array(kinds), np.array(raws), np.array(hits))
    np.testing.assert_allclose(batch.predicted, one.predicted)
    np.testing.assert_array_equal(batch.accepted, one.accepted)
    rows, arr = probe
    got = batch.calibrate_chains(arr, KIND_CONTEXT)
    for i, r in enumerate(rows):
        tree = DraftTree(tuple(range(len(r))), tuple(range(-1, len(r) - 1)), (1.0,) * len(r), tuple(r))
        np.testing.assert_allclose(got[i, :len(r)], batch.calibrate(tree, [KIND_CONTEXT] * len(r)), rtol=1e-12)


@settings(max_examples=300, deadline=None)
@given(chains(), st.integers(0, 300), st.integers(1, 128), st.floats(1.0, 256.0), st.sampled_from([0.0, 0.05, 1.0]))
def test_where_no_draft_pays_the_allocators_keep_none(rows_arr, extra_rows, free, marginal, setup):
    """ForwardCost.draft_pays False (the proposer then skips drafting) means
    neither allocator would keep a token, whatever the confidences (< 1 here:
    at exactly 1 the rate only ties the baseline, up to rounding)."""
    rows, arr = rows_arr
    arr = np.minimum(arr, 0.999)
    rows = [[min(c, 0.999) for c in r] for r in rows]
    cost = ForwardCost(free, marginal, draft_setup=setup)
    num_rows = len(rows) + extra_rows
    if cost.draft_pays(num_rows):
        return
    lengths = np.array([len(r) for r in rows])
    assert not allocate_chain_budget(arr, lengths, None, num_rows, cost).any()
    assert not any(allocate_step_budget(rows, None, num_rows, cost))


def test_draft_pays_at_the_platform_prices():
    gpu, cpu = ForwardCost(64, 64.0), ForwardCost(5, 20.0)
    assert gpu.draft_pays(63) and not gpu.draft_pays(64) and not gpu.draft_pays(256)
    assert cpu.draft_pays(1) and cpu.draft_pays(256)  # each 20 tokens past 5 cost one forward: certain tokens pay
    assert ForwardCost(0, 1.0).draft_pays(10_000)  # no cost model
    # Where it says a draft may pay, a certain one is kept.
    for cost, rows in ((gpu, 63), (cpu, 256)):
        assert allocate_chain_budget(np.ones((rows, 4)), np.full(rows, 4), None, rows, cost).sum() > 0
