"""The proposer's trees and merged sources: native against the reference.

Every setting runs one pipeline (core/tree_plan.py): the draft index's
trees natively, or the sources merged per request (the trie, the Jacobi
pool and window) packed into the same rows. Two proposers, one
with the native extension and one on the references of the index, trie and
planner kernels (lookahead_lab.reference), are driven through the same simulated
workload (tests/vllm/test_chain_path.py). Verification walks each row's tree
(its plan, Jacobi lookahead nodes never accepted) with the text, so side
branches get accepted; most requests may verify trees, some may not (a
penalty: they get chains), some are unknown to the runner. Every step's
drafts and plans, the calibrator's state and the counters must be equal.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lookahead_lab.reference.trees import step_plans, tree_results
from tests.settings import lookahead
from tests.vllm.test_chain_path import MAX_LEN, Workload

pytestmark = pytest.mark.vllm


class TreeWorkload(Workload):
    """Workload whose verification walks each row's tree plan with the text."""

    def __init__(self, seed: int, runner_requests: dict) -> None:
        super().__init__(seed)
        from vllm import SamplingParams

        self.runner_requests = runner_requests
        self.kinds = [SimpleNamespace(sampling_params=SamplingParams(temperature=0.0)),
                      SimpleNamespace(sampling_params=SamplingParams(temperature=0.0, presence_penalty=0.5))]
        self.plans: dict = {}
        # Requests whose plan carried the Jacobi window: the nodes accepted
        # and the text that followed (the window's new tokens stand in).
        self.windows: dict = {}

    def admit(self):
        new = super().admit()
        for req in new:
            pick = self.rng.random()
            if pick < 0.9:  # the rest stay unknown to the runner
                self.runner_requests[req.req_id] = self.kinds[int(pick >= 0.8)]
        return new

    def accepted(self, req_id: str, draft: list[int], truth: list[int]) -> int:
        from lookahead_lab.reference.trees import DraftTree, StepPlan, accepted_path, walk_tree

        plan = self.plans.get(req_id)
        if plan is None:
            return len(accepted_path(DraftTree.chain(draft), truth))
        plan = StepPlan(plan.tree.truncate(len(draft)), plan.lookahead[:len(draft)])
        assert list(plan.tree.tokens) == draft
        targets = iter(truth)
        nodes = walk_tree(plan, lambda _row: next(targets, -1))[0]
        if plan.has_lookahead:
            self.windows[req_id] = (nodes, truth)
        return len(nodes)


def _plans(p, drafted: set[str]) -> dict:
    """The plans of the requests that drafted this step (tree_verify reads
    plans of scheduled drafts only)."""
    return {r: (plan.tree, plan.lookahead) for r, plan in step_plans(p.handed_out).items() if r in drafted}


def drive_trees(a, b, work: TreeWorkload, steps: int) -> tuple[int, int]:
    """Steps both proposers through ``work``, asserting equal drafts, plans
    and calibrator tables after every step; returns the draft tokens handed
    out and the plans made."""
    handed = planned = 0
    for _ in range(steps):
        work.windows = {}
        batch, finished, new, scheduled, sampled, num_tokens, table = work.step_inputs()
        outs = []
        for p in (a, b):
            p.on_step(batch, finished, scheduled)
            width = p.config.profile.jacobi_window
            p.on_tree_results(tree_results([(req_id, len(nodes), nodes, (truth * width)[:width])
                                            for req_id, (nodes, truth) in work.windows.items()]))
            p.on_new_requests(new)
            outs.append(p.propose(sampled, num_tokens, table))
        assert outs[0] == outs[1]
        drafted = {r for r, draft in zip(batch.req_ids, outs[0]) if draft}
        plans = _plans(a, drafted)
        assert plans == _plans(b, drafted)
        work.drafts, work.plans = dict(zip(batch.req_ids, outs[0])), step_plans(a.handed_out)
        handed += sum(map(len, outs[0]))
        planned += len(plans)
        for name in ("predicted", "accepted", "nodes", "_factor"):
            np.testing.assert_array_equal(getattr(a.calibrator, name), getattr(b.calibrator, name))
    return handed, planned


# This CPU's prices keep few side branches (each opens a path: 0.09 + 0.02
# forwards); cases 3 and 4 (no cost model; GPU-like cheap tokens and paths)
# keep many; cases 5 to 9 merge sources per request (the trie, the Jacobi
# pool and window; a trie in chain mode). ``trees``: the fewest plans the
# case must make.
CHEAP_PATHS = {"cost_free_tokens": 48, "cost_marginal_tokens": 32.0, "cost_per_path": 0.01, "path_setup": 0.02,
               "min_draft_confidence": 0.0}


@pytest.mark.parametrize("seed,settings,trees", [
    (0, {"draft_shape": "hier"}, 0),
    (1, {"draft_shape": "par", "load_shrink_above": 4, "load_stop_at": 12}, 0),
    (2, {"draft_shape": "hier", "step_draft_budget": 24, "cost_free_tokens": 16, "cost_marginal_tokens": 8.0}, 0),
    (3, {"draft_shape": "hier", "cost_free_tokens": 0, "min_draft_confidence": 0.0}, 500),
    (4, {"draft_shape": "hier", "load_shrink_above": 8, "load_stop_at": 16, **CHEAP_PATHS}, 200),  # budgets cut at 9+
    (5, {"draft_shape": "hier", "source": "trie", **CHEAP_PATHS}, 50),
    (6, {"draft_shape": "hier", "source": "index+trie", **CHEAP_PATHS}, 50),
    (7, {"draft_shape": "hier", "source": "index+jacobi", "cost_free_tokens": 0, "min_draft_confidence": 0.0}, 200),
    (8, {"draft_shape": "hier", "source": "both", "cost_free_tokens": 0}, 200),
    (9, {"draft_shape": "one", "source": "index+trie", "calibrate_confidence": False}, 0),
])
def test_tree_pipeline_native_equals_reference(seed, settings, trees):
    from lookahead_lab import reference
    from lookahead_lab.reference import on_reference
    from lookahead_lab.standalone import standalone_proposer

    fast = standalone_proposer(16, MAX_LEN, lookahead(**settings))
    ref = on_reference(lambda: standalone_proposer(16, MAX_LEN, lookahead(**settings)))
    before = dict(reference.calls)
    trie = ref.drafter.trie
    assert ref.drafter.index is None or not ref.drafter.index.native
    assert trie is None or type(trie._core).__module__ == "lookahead_lab.reference"
    assert ref.drafter.jacobi is None or type(ref.drafter.jacobi).__module__ == "lookahead_lab.reference.jacobi"
    requests: dict = {}
    fast.verifier.runner_requests = ref.verifier.runner_requests = requests
    handed, planned = drive_trees(fast, ref, TreeWorkload(seed, requests), 200)
    # The reference side ran the reference kernels (merging where sources merge, booking where it learns).
    kernels = ["plan_trees", "match_trees"] + (["merge_rows"] if settings.get("source", "index") != "index" else [])
    kernels += ["observe_trees"] if settings.get("calibrate_confidence", True) else []
    for kernel in kernels:
        assert reference.calls[kernel] > before.get(kernel, 0), kernel
    counters = fast.stats.counters(), ref.stats.counters()
    assert {k: v for k, v in counters[0].items() if k != "propose_ns"} == {
        k: v for k, v in counters[1].items() if k != "propose_ns"}
    assert fast.metrics.skipped_request_steps == ref.metrics.skipped_request_steps
    # The workload exercised what it claims: drafts accepted, rewinds, trees
    # planned and their side branches booked (KIND_BRANCH evidence), the
    # Jacobi window sent and the pool's n-grams accepted where it is on.
    c = counters[0]
    assert handed > 100 and c["rewinds"] > 0 and set(fast.request_ids()) == set(ref.request_ids())
    assert c["context_accepted_tokens"] + c["pool_accepted_tokens"] > 40 or "trie" in settings.get("source", "")
    assert planned >= trees and (not trees or fast.calibrator.nodes[1:].sum() > 0)
    if "jacobi" in settings.get("source", "") or settings.get("source") == "both":
        assert c["jacobi_steps"] > 10 and c["pool_branches"] > 0
    if settings.get("calibrate_confidence") is False:
        assert fast.calibrator.nodes.sum() == 0 and (fast.calibrator.factor_table() == 1).all()
    elif settings.get("draft_shape") == "one":
        assert fast.calibrator.nodes.sum() > 100
