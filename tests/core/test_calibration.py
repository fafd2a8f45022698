"""Online confidence calibration: node kinds, the walk it learns from, the
correction it applies (stated on the pure-Python reference, which the native
kernels are held to in test_tree_plan.py)."""

from __future__ import annotations

import pytest

from lookahead_lab.reference import ReferenceCalibrator as ConfidenceCalibrator
from lookahead_lab.reference.planner import node_kinds
from lookahead_vllm.core.calibration import HALF_LIFE_NODES, KIND_BRANCH, KIND_CHAIN, KIND_POOL
from lookahead_lab.reference.trees import DraftTree, accepted_path

# root -> a(0) -> b(1); a -> d(3) beside b; root -> c(2) beside a; pool n-gram e(4) from the root.
TREE = DraftTree(
    tokens=(10, 11, 12, 13, 14), parents=(-1, 0, -1, 0, -1), weights=(3.0, 2.0, 1.0, 1.0, 0.5),
    confidence=(0.8, 0.5, 0.3, 0.15, 0.2),
)
KINDS = [KIND_CHAIN, KIND_CHAIN, KIND_BRANCH, KIND_BRANCH, KIND_POOL]


def learn(cal: ConfidenceCalibrator, tree: DraftTree, kinds: list[int], emitted: list[int]) -> list[int]:
    """One verified step that emitted ``emitted`` (accepted tokens, then the bonus)."""
    accepted = accepted_path(tree, emitted)
    cal.observe(tree, kinds, accepted)
    return accepted


def test_node_kinds_split_leading_chain_side_branches_and_pool():
    assert node_kinds(TREE, pool_from=4) == KINDS
    assert node_kinds(TREE) == [KIND_CHAIN, KIND_CHAIN, KIND_BRANCH, KIND_BRANCH, KIND_BRANCH]
    assert node_kinds(DraftTree.chain([1, 2, 3])) == [KIND_CHAIN] * 3


def test_without_evidence_confidences_are_raw_and_never_grow_along_a_path():
    cal = ConfidenceCalibrator()
    assert cal.calibrate(TREE, KINDS) == [0.8, 0.5, 0.3, 0.15, 0.2]
    rising = DraftTree((1, 2), (-1, 0), (1.0, 1.0), (0.2, 0.6))  # e.g. a merged shorter-match node
    assert cal.calibrate(rising, [KIND_CHAIN, KIND_CHAIN]) == [0.2, 0.2]


def test_observe_credits_exactly_the_accepted_path():
    cal = ConfidenceCalibrator()
    # The target says a, then d (not b), then 99: a and d accepted, 99 the bonus.
    assert learn(cal, TREE, KINDS, [10, 13, 99]) == [0, 3]
    assert cal.nodes[KIND_CHAIN].sum() == 2 and cal.accepted[KIND_CHAIN].sum() == 1  # a yes, b no
    assert cal.nodes[KIND_BRANCH].sum() == 2 and cal.accepted[KIND_BRANCH].sum() == 1  # d yes, c no
    assert cal.nodes[KIND_POOL].sum() == 1 and cal.accepted[KIND_POOL].sum() == 0
    assert cal.predicted.sum() == pytest.approx(0.8 + 0.5 + 0.3 + 0.15 + 0.2)
    # Nothing accepted: only the bonus came out.
    assert learn(cal, TREE, KINDS, [42]) == [] and cal.accepted.sum() == 2


def test_rejected_side_branches_are_discounted_and_accepted_chains_raised():
    cal = ConfidenceCalibrator(prior=8.0)
    for _ in range(200):
        learn(cal, TREE, KINDS, [10, 11, 99])  # the chain a, b always; side branches and pool never
    a, b, c, d, e = cal.calibrate(TREE, KINDS)
    assert a == pytest.approx(min(1.0, 0.8 * (200 + 8) / (160 + 8)))
    assert b == pytest.approx(min(a, 0.5 * (200 + 8) / (100 + 8)))
    assert c == pytest.approx(0.3 * 8 / (60 + 8)) and c < 0.05
    assert d == pytest.approx(0.15 * 8 / (30 + 8))
    assert e == pytest.approx(0.2 * 8 / (40 + 8))
    # Another kind in the same confidence bin keeps its own correction.
    assert cal.calibrate(DraftTree.chain([7]), [KIND_CHAIN])[0] == 1.0


def test_counts_halve_after_the_half_life_so_the_correction_can_move():
    cal = ConfidenceCalibrator()
    chain = DraftTree((1,), (-1,), (1.0,), (0.5,))
    for _ in range(HALF_LIFE_NODES + 10):
        learn(cal, chain, [KIND_CHAIN], [2])  # never accepted
    assert 0 < cal.nodes[KIND_CHAIN].sum() < HALF_LIFE_NODES
    low = cal.calibrate(chain, [KIND_CHAIN])[0]
    assert low < 0.01
    for _ in range(HALF_LIFE_NODES):
        learn(cal, chain, [KIND_CHAIN], [1, 2])  # the workload changed: always accepted now
    assert cal.calibrate(chain, [KIND_CHAIN])[0] > 0.5 > low


def test_summary_reports_the_bins_that_saw_nodes():
    cal = ConfidenceCalibrator()
    learn(cal, TREE, KINDS, [12, 99])  # c accepted
    rows = cal.summary()
    assert [r["acceptance"] for r in rows["branch"]] == [0.0, 1.0]  # d (0.15) no, c (0.3) yes
    assert rows["branch"][1]["low"] == 0.2 and rows["branch"][1]["high"] == 0.3
    assert len(rows["chain"]) == 2 and len(rows["pool"]) == 1


def test_prior_must_be_positive():
    with pytest.raises(ValueError, match="prior=0"):
        ConfidenceCalibrator(prior=0)
