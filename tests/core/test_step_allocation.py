"""The cost model's step allocation: where no draft can pay, nothing is kept."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_vllm.core.budget import ForwardCost
from lookahead_lab.reference.planner import allocate_step_budget

confidence = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.1, 0.5, 1.0]))  # ties too


@st.composite
def chains(draw):
    """Rows of non-increasing confidences (as calibration leaves them)."""
    rows = draw(st.lists(st.lists(confidence, max_size=8), min_size=1, max_size=8))
    return [sorted(r, reverse=True) for r in rows]


@settings(max_examples=300, deadline=None)
@given(chains(), st.integers(0, 300), st.integers(1, 128), st.floats(1.0, 256.0), st.sampled_from([0.0, 0.05, 1.0]))
def test_where_no_draft_pays_the_allocator_keeps_none(rows, extra_rows, free, marginal, setup):
    """ForwardCost.draft_pays False (the proposer then skips drafting) means
    the allocator would keep no token, whatever the confidences (< 1 here:
    at exactly 1 the rate only ties the baseline, up to rounding)."""
    rows = [[min(c, 0.999) for c in r] for r in rows]
    cost = ForwardCost(free, marginal, draft_setup=setup)
    num_rows = len(rows) + extra_rows
    if cost.draft_pays(num_rows):
        return
    assert not any(allocate_step_budget(rows, None, num_rows, cost))


def test_draft_pays_at_the_platform_prices():
    gpu, cpu = ForwardCost(64, 64.0), ForwardCost(5, 20.0)
    assert gpu.draft_pays(63) and not gpu.draft_pays(64) and not gpu.draft_pays(256)
    assert cpu.draft_pays(1) and cpu.draft_pays(256)  # each 20 tokens past 5 cost one forward: certain tokens pay
    assert ForwardCost(0, 1.0).draft_pays(10_000)  # no cost model
    # Where it says a draft may pay, a certain one is kept.
    for cost, rows in ((gpu, 63), (cpu, 256)):
        assert sum(allocate_step_budget([[1.0] * 4] * rows, None, rows, cost)) > 0


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([0, 1, 5, 32]), st.floats(1.0, 700.0), st.floats(0.0, 0.2), st.floats(0.0, 0.5),
       st.lists(st.tuples(st.integers(0, 400), st.integers(0, 9)), min_size=1, max_size=20))
def test_cost_over_arrays_equals_the_cost_of_each_step(free, marginal, per_path, path_setup, steps):
    """``ForwardCost.many`` gives what ``ForwardCost(...)`` gives step by step, bit for bit (the
    Jacobi windows are chosen with it: the Jacobi table's choose)."""
    cost = ForwardCost(free, marginal, per_path, path_setup)
    tokens, paths = zip(*steps)
    assert cost.many(list(tokens), list(paths)).tolist() == [cost(t, p) for t, p in steps]
