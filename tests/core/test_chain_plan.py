"""The native chain kernels equal their pure-Python reference (core/chain_plan.py).

Same inputs through both: the offers matched, the calibrator's tables after
the same bookings (bit for bit, half-life halvings included), and each
step's kept prefixes, calibrated confidences and drafts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_vllm.core import calibration
from lookahead_vllm.core.budget import ForwardCost
from lookahead_vllm.core.calibration import KIND_CHAIN, KIND_CONTEXT, ConfidenceCalibrator
from lookahead_vllm.core.chain_plan import ChainOffers, plan_chains
from lookahead_vllm.core.native import load_extension

pytestmark = pytest.mark.skipif(load_extension() is None, reason="native extension not built (pip install -e .)")

# Confidences with ties and bin edges among them.
confidence = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.02, 0.1, 0.5, 0.9, 1.0]))
COSTS = [ForwardCost(0, 1.0), ForwardCost(5, 20.0), ForwardCost(16, 4.0), ForwardCost(64, 64.0), ForwardCost(1, 33.0),
         ForwardCost(5, 20.0, draft_setup=0.05), ForwardCost(32, 675.0, draft_setup=0.3)]


@st.composite
def offers_and_rows(draw):
    """Last step's offers over some slots, and this step's rows (some with an
    offer, some without, some that verified nothing)."""
    slots = draw(st.lists(st.integers(0, 40), unique=True, max_size=24))
    width = draw(st.integers(0, 8))
    lengths = [draw(st.integers(0, width)) for _ in slots]
    raw = np.array([[draw(confidence) for _ in range(width)] for _ in slots]).reshape(len(slots), width)
    rows = draw(st.lists(st.integers(0, 48), unique=True, max_size=24))
    scheduled = [draw(st.integers(0, 10)) for _ in rows]
    emitted = [draw(st.integers(1, 11)) for _ in rows]
    offers = ChainOffers(np.array(slots, np.int64), raw, np.array(lengths, np.int64))
    return offers, *(np.array(x, np.int64) for x in (rows, scheduled, emitted))


@settings(max_examples=300, deadline=None)
@given(offers_and_rows())
def test_match_equals_reference(case):
    offers, slots, scheduled, emitted = case
    want = offers.match(slots, scheduled, emitted, native=False)
    got = offers.match(slots, scheduled, emitted, native=True)
    for w, g in zip(want, got):
        assert g.dtype == np.int64 and g.tolist() == w.tolist()
    at, verified, accepted = want
    # Every booked row verified a node of its offer, and accepted at most that.
    assert ((verified > 0) & (verified <= offers.lengths[at]) & (accepted <= verified)).all()


def test_match_worked_example():
    offers = ChainOffers(np.array([7, 3, 9]), np.zeros((3, 4)), np.array([4, 2, 0]))
    # slot 3 verified 5 of its 2 tokens (cut to 2) and emitted 2 (1 accepted);
    # slot 7 verified 4, emitted 5 (all 4 accepted); slot 9 offered nothing;
    # slot 8 had no offer; slot 7's row below it verified nothing.
    at, verified, accepted = offers.match(np.array([3, 9, 8, 7]), np.array([5, 3, 3, 4]), np.array([2, 1, 4, 5]),
                                          native=True)
    assert (at.tolist(), verified.tolist(), accepted.tolist()) == ([1, 0], [2, 4], [1, 4])


@st.composite
def bookings(draw):
    """A few steps of offers and their verified/accepted prefixes."""
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        rows, width = draw(st.integers(1, 12)), draw(st.integers(1, 10))
        raw = np.array([[draw(confidence) for _ in range(width)] for _ in range(rows)])
        at = draw(st.lists(st.integers(0, rows - 1), max_size=rows))
        verified = [draw(st.integers(1, width)) for _ in at]
        accepted = [draw(st.integers(0, v)) for v in verified]
        steps.append((raw, *(np.array(x, np.int64) for x in (at, verified, accepted))))
    return steps


@settings(max_examples=200, deadline=None)
@given(bookings(), st.sampled_from([KIND_CONTEXT, KIND_CHAIN]), st.sampled_from([4, 16, 4096]))
def test_observe_chains_equals_reference(steps, kind, half_life):
    """Tables equal bit for bit after the same bookings (a small half-life
    makes the halving happen)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(calibration, "HALF_LIFE_NODES", half_life)
    try:
        ref, nat = ConfidenceCalibrator(prior=2.0), ConfidenceCalibrator(prior=2.0, native=True)
        for raw, at, verified, accepted in steps:
            ref.observe_chains(raw, at, verified, accepted, kind)
            nat.observe_chains(raw, at, verified, accepted, kind)
            for name in ("predicted", "accepted", "nodes", "_factor"):
                np.testing.assert_array_equal(getattr(nat, name), getattr(ref, name), err_msg=name)
    finally:
        mp.undo()
    assert nat.nodes.sum() <= sum(int(s[2].sum()) for s in steps)


@st.composite
def step_chains(draw):
    """A step's raw chains (not monotone: calibration makes them so), their
    tokens, batch rows and lengths."""
    rows, width = draw(st.integers(0, 10)), draw(st.integers(0, 9))
    raw = np.array([[draw(confidence) for _ in range(width)] for _ in range(rows)]).reshape(rows, width)
    tokens = np.array(draw(st.lists(st.integers(0, 50_000), min_size=rows * width, max_size=rows * width)),
                      np.int32).reshape(rows, width)
    lens = np.array([draw(st.integers(0, width)) for _ in range(rows)], np.int32)
    num_out = rows + draw(st.integers(0, 4))
    out_rows = np.array(draw(st.permutations(range(num_out)))[:rows], np.int64)
    return tokens, raw, lens, out_rows, num_out


@settings(max_examples=300, deadline=None)
@given(step_chains(), bookings(), st.one_of(st.none(), st.integers(0, 30)), st.integers(0, 8),
       st.sampled_from(COSTS))
def test_plan_chains_equals_reference(chains, history, budget, extra_rows, cost):
    tokens, raw, lens, out_rows, num_out = chains
    calibrator = ConfidenceCalibrator(prior=2.0)
    for raw_h, at, verified, accepted in history:  # factors away from 1
        calibrator.observe_chains(raw_h, at, verified, accepted, KIND_CONTEXT)
    num_rows = len(lens) + extra_rows
    args = (tokens, raw, lens, calibrator, KIND_CONTEXT, budget, num_rows, cost, out_rows, num_out)
    keep_ref, cal_ref, drafts_ref = plan_chains(*args, native=False)
    keep, cal, drafts = plan_chains(*args, native=True)
    assert keep.dtype == np.int64 and keep.tolist() == keep_ref.tolist()
    assert drafts == drafts_ref
    for r, n in enumerate(lens.tolist()):
        np.testing.assert_array_equal(cal[r, :n], cal_ref[r, :n])
    assert (keep <= lens).all() and (budget is None or keep.sum() <= budget)
    for r, n in enumerate(keep.tolist()):
        assert drafts[out_rows[r]] == tokens[r, :n].tolist()


def test_plan_chains_worked_example():
    """No correction yet (factors 1): confidences become non-increasing along
    each row; at this CPU's prices (5 tokens free, 20 more per forward) and
    two rows, the certain nodes pay and the 0.05 ones do not."""
    raw = np.array([[0.9, 0.95, 0.05, 0.0], [0.8, 0.05, 0.0, 0.0]])
    tokens = np.array([[11, 12, 13, 14], [21, 22, 23, 24]], np.int32)
    for native in (False, True):
        keep, cal, drafts = plan_chains(tokens, raw, np.array([3, 2], np.int32), ConfidenceCalibrator(),
                                        KIND_CONTEXT, None, 2, ForwardCost(5, 20.0), np.array([2, 0]), 3, native)
        assert keep.tolist() == [2, 1]
        assert cal[0, :3].tolist() == [0.9, 0.9, 0.05] and cal[1, :2].tolist() == [0.8, 0.05]
        assert drafts == [[21], [], [11, 12]]


def test_the_draft_setup_keeps_weak_drafts_out():
    """A step that carries any draft pays ``draft_setup`` once: one node of
    confidence 0.3 raises a single row's expected throughput for free
    (1.3 > 1) but not past a 0.4-forward setup (1.3 / 1.4 < 1); two certain
    nodes still pay it (3 / 1.4 > 1)."""
    tokens = np.array([[7, 8]], np.int32)
    for native in (False, True):
        def keep(raw, setup):
            return plan_chains(tokens, np.array([raw]), np.array([2], np.int32), ConfidenceCalibrator(), KIND_CONTEXT,
                               None, 1, ForwardCost(5, 20.0, draft_setup=setup), np.array([0]), 1, native)[0].tolist()
        assert keep([0.3, 0.0], 0.0) == [1] and keep([0.3, 0.0], 0.4) == [0]
        assert keep([1.0, 1.0], 0.4) == [2]


def test_kernels_refuse_bad_arguments():
    k = load_extension()
    cal = ConfidenceCalibrator(native=True)
    raw, tokens = np.zeros((2, 3)), np.zeros((2, 3), np.int32)
    with pytest.raises(TypeError, match="predicted must be a writeable C-contiguous float64"):
        k.observe_chains(cal.predicted.astype(np.float32), cal.accepted, cal.nodes, cal._factor, cal.bin_edges,
                         KIND_CONTEXT, raw, [0], [1], [0], 1.0, 16.0)
    with pytest.raises(ValueError, match=r"kind=9: must be in \[0, 4\)"):
        k.observe_chains(cal.predicted, cal.accepted, cal.nodes, cal._factor, cal.bin_edges, 9, raw, [0], [1], [0],
                         1.0, 16.0)
    with pytest.raises(IndexError, match=r"at\[0\]=2"):
        cal.observe_chains(raw, np.array([2]), np.array([1]), np.array([0]), KIND_CONTEXT)
    with pytest.raises(IndexError, match=r"verified=4: outside raw \[2, 3\]"):
        cal.observe_chains(raw, np.array([0]), np.array([4]), np.array([0]), KIND_CONTEXT)
    assert not cal.nodes.any()  # nothing booked by the refused calls
    plan = dict(edges=cal.bin_edges, factors=cal.factors(KIND_CONTEXT), budget=-1, num_rows=2, free_tokens=5,
                marginal_tokens=20.0)
    with pytest.raises(ValueError, match=r"lens\[1\]=4: must be in \[0, 3\]"):
        k.plan_chains(tokens, raw, [1, 4], out_rows=[0, 1], num_out=2, **plan)
    with pytest.raises(IndexError, match=r"out_rows\[1\]=2: must be in \[0, 2\)"):
        k.plan_chains(tokens, raw, [1, 1], out_rows=[0, 2], num_out=2, **plan)
    with pytest.raises(ValueError, match="a batch row given twice"):
        k.plan_chains(tokens, raw, [1, 1], out_rows=[1, 1], num_out=2, **plan)
    with pytest.raises(ValueError, match="marginal_tokens > 0"):
        k.plan_chains(tokens, raw, [1, 1], out_rows=[0, 1], num_out=2, **{**plan, "marginal_tokens": 0.0})
    with pytest.raises(ValueError, match="draft_setup=-0.1.*: must be >= 0"):
        k.plan_chains(tokens, raw, [1, 1], out_rows=[0, 1], num_out=2, **{**plan, "draft_setup": -0.1})
    with pytest.raises(ValueError, match="same length"):
        k.match_offers([1, 2], [1], [1], [1], [2])
    with pytest.raises(TypeError, match="factors one longer than edges"):
        k.plan_chains(tokens, raw, [1, 1], out_rows=[0, 1], num_out=2, **{**plan, "factors": np.ones(3)})


def test_factors_are_read_only_and_native_needs_the_extension(monkeypatch):
    cal = ConfidenceCalibrator()
    with pytest.raises(ValueError):
        cal.factors(KIND_CONTEXT)[0] = 2.0
    cal.observe_chains(np.array([[0.5]]), np.array([0]), np.array([1]), np.array([1]), KIND_CONTEXT)
    assert cal.factors(KIND_CONTEXT)[6] > 1  # the calibrator itself still learns (bin of 0.5)
    monkeypatch.setattr(calibration, "load_extension", lambda: None)
    with pytest.raises(ImportError, match="not built"):
        ConfidenceCalibrator(native=True)
