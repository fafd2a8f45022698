"""The proposer's array path for trees equals its per-request path.

As tests/vllm/test_chain_path.py does for chains, in tree mode
(``draft_shape`` ``hier``/``par``, the draft index alone): two proposers, one
on the array path (core/tree_plan.py) and one forced onto the per-request
path, driven through the same simulated workload. Verification walks each
row's tree (its plan) with the text, so side branches get accepted; most
requests may verify trees, some may not (a penalty: they get chains), some
are unknown to the runner. Every step's drafts and plans, the calibrator's
state and the counters must be equal.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

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

    def admit(self):
        new = super().admit()
        for req in new:
            pick = self.rng.random()
            if pick < 0.9:  # the rest stay unknown to the runner
                self.runner_requests[req.req_id] = self.kinds[int(pick >= 0.8)]
        return new

    def accepted(self, req_id: str, draft: list[int], truth: list[int]) -> int:
        from lookahead_vllm.core.draft_tree import DraftTree
        from lookahead_vllm.core.step_plan import accepted_path

        plan = self.plans.get(req_id)
        tree = plan.tree.truncate(len(draft)) if plan is not None else DraftTree.chain(draft)
        assert list(tree.tokens) == draft
        return len(accepted_path(tree, truth))


def _plans(p, drafted: set[str]) -> dict:
    """The plans of the requests that drafted this step (the per-request path
    keeps a row's last plan through a step in which it sampled nothing;
    tree_verify reads plans of scheduled drafts only)."""
    return {r: (plan.tree, plan.lookahead) for r, plan in p.plans.items() if r in drafted}


def drive_trees(a, b, work: TreeWorkload, steps: int) -> tuple[int, int]:
    """Steps both proposers through ``work``, asserting equal drafts, plans
    and calibrator tables after every step; returns the draft tokens handed
    out and the plans made."""
    handed = planned = 0
    for _ in range(steps):
        batch, finished, new, scheduled, sampled, num_tokens, table = work.step_inputs()
        outs = []
        for p in (a, b):
            p.on_step(batch, finished, scheduled)
            p.on_new_requests(new)
            outs.append(p.propose(sampled, num_tokens, table))
        assert outs[0] == outs[1]
        drafted = {r for r, draft in zip(batch.req_ids, outs[0]) if draft}
        plans = _plans(a, drafted)
        assert plans == _plans(b, drafted)
        work.drafts, work.plans = dict(zip(batch.req_ids, outs[0])), a.plans
        handed += sum(map(len, outs[0]))
        planned += len(plans)
        for name in ("predicted", "accepted", "nodes", "_factor"):
            np.testing.assert_array_equal(getattr(a.calibrator, name), getattr(b.calibrator, name))
    return handed, planned


# This CPU's prices keep few side branches (each opens a path: 0.09 + 0.02
# forwards); cases 3 and 4 (no cost model; GPU-like cheap tokens and paths)
# keep many. ``trees``: the fewest plans the case must make.
@pytest.mark.parametrize("seed,settings,trees", [
    (0, {"draft_shape": "hier"}, 0),
    (1, {"draft_shape": "par", "load_shrink_above": 4, "load_stop_at": 12}, 0),
    (2, {"draft_shape": "hier", "step_draft_budget": 24, "cost_free_tokens": 16, "cost_marginal_tokens": 8.0}, 0),
    (3, {"draft_shape": "hier", "cost_free_tokens": 0, "min_draft_confidence": 0.0}, 500),
    (4, {"draft_shape": "hier", "cost_free_tokens": 48, "cost_marginal_tokens": 32.0, "cost_per_path": 0.01,
         "path_setup": 0.02, "min_draft_confidence": 0.0}, 200),
])
def test_tree_array_path_equals_per_request_path(seed, settings, trees):
    from lookahead_lab.standalone import standalone_proposer

    fast, slow = (standalone_proposer(16, MAX_LEN, lookahead(**settings)) for _ in range(2))
    assert fast.batch_trees and not fast.batch_chains
    slow.batch_trees = False
    requests: dict = {}
    fast.verifier.runner_requests = slow.verifier.runner_requests = requests
    handed, planned = drive_trees(fast, slow, TreeWorkload(seed, requests), 200)
    counters = fast.stats.counters(), slow.stats.counters()
    for key in ("request_steps", "rewinds", "context_drafts", "context_accepted_tokens", "draft_tokens",
                "max_step_draft_tokens"):
        assert counters[0][key] == counters[1][key], key
    assert fast.metrics.skipped_request_steps == slow.metrics.skipped_request_steps
    # The workload exercised what it claims: drafts accepted, rewinds, trees
    # planned and their side branches booked (KIND_BRANCH evidence).
    assert handed > 100 and counters[0]["context_accepted_tokens"] > 40 and counters[0]["rewinds"] > 0
    assert planned >= trees and (not trees or fast.calibrator.nodes[1].sum() > 0)
    assert set(fast.request_ids()) == set(slow.request_ids())


def test_tree_array_path_without_the_extension_equals_the_native_one(monkeypatch):
    """Where the extension is not built, the tree array path runs the
    reference index and the reference tree kernels: the same drafts, plans,
    calibrator tables and counters."""
    from lookahead_lab.standalone import standalone_proposer
    from lookahead_vllm.core import native

    settings = lookahead(draft_shape="hier", cost_free_tokens=48, cost_marginal_tokens=32.0, cost_per_path=0.01,
                         path_setup=0.02, min_draft_confidence=0.0)
    fast = standalone_proposer(16, MAX_LEN, settings)
    monkeypatch.setattr(native, "load_draft_index", lambda: None)
    ref = standalone_proposer(16, MAX_LEN, settings)
    assert fast.drafter.native and not ref.drafter.native and ref.batch_trees and not ref.calibrator.native
    requests: dict = {}
    fast.verifier.runner_requests = ref.verifier.runner_requests = requests
    handed, planned = drive_trees(fast, ref, TreeWorkload(5, requests), 150)
    counters = fast.stats.counters(), ref.stats.counters()
    assert {k: v for k, v in counters[0].items() if k != "propose_ns"} == {
        k: v for k, v in counters[1].items() if k != "propose_ns"}
    assert handed > 100 and planned > 10
