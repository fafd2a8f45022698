"""Tree verification's host work batched over the step, held to request-by-request references.

``TreeVerifier.begin_step`` gives every tree row its position in one indexed write and
``finish_step`` reads the tree rows' greedy targets in one argmax and writes the walks' rows
at once (a GPU step then pays a few transfers, not a few per tree). The references below
do the same request by request, as the verifier did before: positions as a slice per
request, each request's targets from its own rows' argmax, each sampled row drawn from its
own generator. Greedy, sampled and chain-only requests, Jacobi windows, rows of chain
requests between the trees.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lookahead_vllm.core.draft_tree import DraftTree
from lookahead_vllm.core.jacobi import output_nodes
from lookahead_vllm.core.step_plan import StepPlan, walk_tree
from lookahead_vllm.ops.sampling import sample_row

pytestmark = pytest.mark.vllm

WINDOW, NGRAM = 3, 3
WINDOW_NODES = WINDOW * (NGRAM - 1)  # every level of the window: the plan's lookahead nodes


def _random_plan(rng: np.random.Generator, vocab: int, window: bool) -> StepPlan:
    n = int(rng.integers(2, 12))
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    parents[1] = 0  # a leading chain of at least two nodes
    if not window:
        parents[-1] = n - 3 if n > 3 else -1  # off the chain: a tree, not a chain
    tokens = rng.integers(0, vocab, n).tolist()
    ahead = ()
    if window:  # a Jacobi window's nodes after the verify nodes (structure as the proposer lays it out)
        tokens += rng.integers(0, vocab, WINDOW_NODES).tolist()
        parents += [-1 if i < WINDOW else n + i - WINDOW for i in range(WINDOW_NODES)]
        ahead = (False,) * n + (True,) * WINDOW_NODES
    return StepPlan(DraftTree(tuple(tokens), tuple(parents), (1.0,) * len(tokens)), ahead)


def _step(seed: int, vocab: int = 64):
    """A runner, scheduler output and logits for ~12 requests: trees (greedy, sampled, one
    only verifying its leading chain, some with a window) and chain requests between them."""
    from vllm import SamplingParams

    from lookahead_vllm.vllm.tree_verify import TreeVerifier

    rng = np.random.default_rng(seed)
    kinds = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.9, top_k=20),
             "chain_only": SamplingParams(temperature=0.0, presence_penalty=0.5)}
    plans, drafts, states, num_tokens = {}, {}, {}, []
    for i in range(12):
        req_id = f"r{i}"
        kind = ["greedy", "sampled", "chain_only", "chain"][int(rng.integers(4))]
        if kind == "chain":  # a request vLLM verifies as a chain: rows between the trees
            drafts[req_id] = rng.integers(0, vocab, int(rng.integers(1, 5))).tolist()
            states[req_id] = SimpleNamespace(sampling_params=kinds["greedy"])
        else:
            plan = _random_plan(rng, vocab, window=kind == "greedy" and rng.random() < 0.5)
            plans[req_id], drafts[req_id] = plan, list(plan.tree.tokens)
            states[req_id] = SimpleNamespace(sampling_params=kinds[kind])
        num_tokens.append(len(drafts[req_id]) + 1)
    num_tokens = np.asarray(num_tokens, np.int32)
    logits = torch.randn(int(num_tokens.sum()), vocab, generator=torch.Generator().manual_seed(seed))
    starts = np.cumsum(num_tokens) - num_tokens
    for i, (req_id, plan) in enumerate((r, plans.get(r)) for r in drafts):
        node = -1  # make some targets follow the tree so walks go deep
        while plan is not None and rng.random() < 0.8:
            kids = [c for c in plan.tree.children()[node] if not (plan.lookahead and plan.lookahead[c])]
            if not kids:
                break
            child = kids[int(rng.integers(len(kids)))]
            logits[starts[i] + node + 1, plan.tree.tokens[child]] += 50.0
            node = child
    cfg = SimpleNamespace(profile=SimpleNamespace(debug_disable=("compaction",), jacobi_window=WINDOW,
                                                  jacobi_ngram=NGRAM), lookahead_nodes=WINDOW_NODES)
    results: list = []
    runner = SimpleNamespace(
        drafter=SimpleNamespace(handed_out=SimpleNamespace(rows=plans, plan=plans.get), config=cfg, on_tree_truncated=lambda n: None,
                                on_tree_results=results.append),
        requests=states, positions=torch.arange(int(num_tokens.sum()), dtype=torch.int64) * 7 + 3,
        input_batch=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(drafts)},
                                    generators={i: torch.Generator().manual_seed(seed * 100 + i)
                                                for i in range(len(drafts))}))
    spec = SimpleNamespace(cu_num_sampled_tokens=torch.from_numpy(np.cumsum(num_tokens)))
    sampled = torch.from_numpy(rng.integers(0, vocab, (len(drafts), 16)).astype(np.int32))
    return TreeVerifier(), runner, SimpleNamespace(scheduled_spec_decode_tokens=drafts), num_tokens, logits, spec, \
        sampled, results


def _reference(runner, num_tokens, logits, sampled, seed):
    """Request by request: positions, walks and rows as the verifier computed them one tree at a time."""
    from lookahead_vllm.vllm.tree_verify import GREEDY_EPS, tree_verifiable

    positions, sampled = runner.positions.clone(), sampled.clone()
    starts = np.cumsum(num_tokens) - num_tokens
    cu = np.cumsum(num_tokens)
    generators = {i: torch.Generator().manual_seed(seed * 100 + i) for i in range(len(num_tokens))}
    results = []
    for req_id, row in runner.input_batch.req_id_to_index.items():
        plan = runner.drafter.handed_out.plan(req_id)
        if plan is None or plan.is_chain():
            continue
        start, n = int(starts[row]), plan.num_nodes + 1
        positions[start:start + n] = positions[start] + torch.from_numpy(plan.position_offsets())
        rows = logits[cu[row] - n:cu[row]]
        sp = runner.requests[req_id].sampling_params
        if not tree_verifiable(sp):  # the stock chain result cut to the leading chain
            tokens = [t for t in sampled[row].tolist() if t >= 0]
            keep = min(len(tokens) - 1, plan.chain_prefix_length())
            nodes, tokens = list(range(keep)), tokens[:keep + 1]
        elif sp.temperature < GREEDY_EPS:
            nodes, tokens = walk_tree(plan, rows.argmax(dim=-1).tolist().__getitem__)
        else:
            nodes, tokens = walk_tree(plan, lambda i: sample_row(rows[i], sp.temperature, sp.top_k, sp.top_p,
                                                                 generators[row]))
        sampled[row] = torch.tensor(tokens + [-1] * (sampled.shape[1] - len(tokens)), dtype=sampled.dtype)
        window = None
        if plan.has_lookahead:
            base = plan.lookahead.index(True)
            window = rows[[0 if c < 0 else 1 + base + c for c in output_nodes(WINDOW, NGRAM)]].argmax(-1).tolist()
        results.append((req_id, plan.num_nodes, nodes, tokens, window))
    return positions, sampled, results


@pytest.mark.parametrize("seed", range(12))
def test_batched_host_work_equals_request_by_request(seed):
    verifier, runner, sched, num_tokens, logits, spec, sampled, results = _step(seed)
    positions, expected_sampled, expected = _reference(runner, num_tokens, logits, sampled, seed)
    assert expected, "the step must carry trees"
    verifier.begin_step(runner, sched, num_tokens)
    assert torch.equal(runner.positions, positions)
    out = SimpleNamespace(sampled_token_ids=sampled)
    verifier.finish_step(runner, logits, spec, out)
    got = [(r.req_id, r.num_nodes, r.nodes, r.tokens, r.window_tokens) for r in results[0]]
    assert got == expected
    assert torch.equal(out.sampled_token_ids, expected_sampled)


def test_reference_sees_a_wrong_position():
    """The comparison can fail: a tree whose rows keep their chain positions differs."""
    verifier, runner, sched, num_tokens, logits, spec, sampled, _ = _step(0)
    positions, _, _ = _reference(runner, num_tokens, logits, sampled, 0)
    runner.drafter.config.profile.debug_disable = ("positions", "compaction")
    verifier.begin_step(runner, sched, num_tokens)
    assert not torch.equal(runner.positions, positions)


def _uncovered_paths_reference(plan: StepPlan) -> list[tuple[list[int], int]]:
    """Leaf by leaf, the whole path, its rows not computed yet counted (the rows done: the leading chain,
    then every path's rows)."""
    kids = plan.tree.children()
    done = set(range(plan.chain_prefix_length() + 1))
    out = []
    for leaf in (i for i in range(plan.num_nodes) if not kids[i]):
        path = [0] + [n + 1 for n in plan.tree.path_to(leaf)]
        tail = sum(1 for r in path if r not in done)
        if tail:
            assert all(r not in done for r in path[-tail:])
            out.append((path, tail))
            done.update(path)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_uncovered_paths_equal_the_leaf_by_leaf_reference(seed):
    """The path rounds' paths (walked up from each leaf to the first computed row) against whole paths
    counted leaf by leaf: random parent-first trees, with and without a Jacobi window, truncated."""
    from lookahead_vllm.vllm.tree_verify import _uncovered_paths

    rng = np.random.default_rng(seed)
    plan = _random_plan(rng, 50, window=bool(seed % 2))
    if seed % 3 == 0:  # any parent-first tree, not only the shapes above
        n = int(rng.integers(1, 20))
        parents = tuple(int(rng.integers(-1, i)) for i in range(n))
        plan = StepPlan(DraftTree(tuple(range(n)), parents, (1.0,) * n))
    for k in (plan.num_nodes, max(1, plan.num_nodes - 3)):
        cut = plan.truncate(k)
        assert _uncovered_paths(cut) == _uncovered_paths_reference(cut)
