"""StepPlan rows (positions, visibility) and the tree acceptance walk."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_lab.reference.trees import DraftTree, StepPlan, walk_tree

# Seed 000 Fig. 2c: "on a table", "on a chair", "on my knee".
FIG2 = DraftTree(tokens=(1, 2, 3, 4, 5, 6), parents=(-1, 0, 1, 1, 0, 4), weights=(6, 5, 4, 3, 2, 1))


def test_positions_and_visibility_fig2():
    plan = StepPlan(FIG2)
    assert plan.position_offsets().tolist() == [0, 1, 2, 3, 3, 2, 3]
    vis = plan.visibility()
    # rows: root, on, a, table, chair, my, knee
    assert vis[0].tolist() == [1, 0, 0, 0, 0, 0, 0]
    assert vis[3].tolist() == [1, 1, 1, 1, 0, 0, 0]  # table: root, on, a, itself
    assert vis[4].tolist() == [1, 1, 1, 0, 1, 0, 0]  # chair does not see table
    assert vis[6].tolist() == [1, 1, 0, 0, 0, 1, 1]  # knee: root, on, my, itself
    assert not plan.is_chain() and plan.chain_prefix_length() == 3


def test_chain_plan_is_causal():
    plan = StepPlan(DraftTree.chain([7, 8, 9]))
    assert plan.is_chain() and plan.chain_prefix_length() == 3
    assert np.array_equal(plan.visibility(), np.tril(np.ones((4, 4), dtype=bool)))
    assert plan.position_offsets().tolist() == [0, 1, 2, 3]


def test_walk_accepts_second_branch_and_bonus():
    # target after root = 1 (on), after "on" = 5 (my), after "my" = 6 (knee), after knee = 42
    targets = {0: 1, 1: 5, 5: 6, 6: 42}
    calls = []

    def target_at(row):
        calls.append(row)
        return targets.get(row, -7)

    nodes, tokens = walk_tree(StepPlan(FIG2), target_at)
    assert nodes == [0, 4, 5]
    assert tokens == [1, 5, 6, 42]
    assert calls == [0, 1, 5, 6]  # lazily, only reached rows


def test_walk_rejects_at_root():
    nodes, tokens = walk_tree(StepPlan(FIG2), lambda row: 99)
    assert nodes == [] and tokens == [99]


@st.composite
def trees(draw):
    k = draw(st.integers(1, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(k)]
    tokens = [draw(st.integers(0, 4)) for _ in range(k)]
    return DraftTree(tuple(tokens), tuple(parents), tuple(float(k - i) for i in range(k)))


@settings(max_examples=200, deadline=None)
@given(trees(), st.lists(st.integers(0, 4), min_size=13, max_size=13))
def test_walk_output_is_a_real_path(tree, row_targets):
    """Accepted nodes form a root-to-node path whose tokens equal the targets of their parents' rows."""
    plan = StepPlan(tree)
    nodes, tokens = walk_tree(plan, lambda row: row_targets[row])
    if nodes:
        assert tree.path_to(nodes[-1]) == nodes
    rows = [0] + [n + 1 for n in nodes]
    assert tokens == [row_targets[r] for r in rows]
    # The walk stopped: no child of the last node carries the bonus token.
    last = nodes[-1] if nodes else -1
    assert all(tree.tokens[c] != tokens[-1] for c in tree.children()[last])
    # Visibility rows are exactly ancestor sets + root.
    vis = plan.visibility()
    for i in range(len(tree)):
        assert set(np.flatnonzero(vis[i + 1])) == {0} | {n + 1 for n in tree.path_to(i)}


def test_lookahead_nodes_come_after_every_verify_node():
    """The walks read a plan's verify nodes as its leading ones (``verify_nodes``): a plan with a
    lookahead node before a verify node is refused."""
    tree = DraftTree((1, 2, 3), (-1, 0, -1), (1.0, 1.0, 1.0))
    assert StepPlan(tree, (False, True, True)).verify_nodes == 1
    assert StepPlan(tree).verify_nodes == StepPlan(tree, (False,) * 3).verify_nodes == 3
    with pytest.raises(ValueError, match="must follow every verify node"):
        StepPlan(tree, (False, True, False))
