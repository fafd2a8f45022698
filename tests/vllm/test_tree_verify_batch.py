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

from lookahead_vllm.core.jacobi import output_nodes
from lookahead_lab.reference.trees import (DraftTree, StepPlan, batch_plan, step_plan, step_plans, tree_result_rows,
                                          walk_tree)
from lookahead_vllm.ops.sampling import sample_row

pytestmark = pytest.mark.vllm

WINDOW, NGRAM = 3, 3
WINDOW_NODES = WINDOW * (NGRAM - 1) - 1  # the window's lookahead nodes in a plan


def _random_offer(rng: np.random.Generator, vocab: int, window: bool) -> tuple[list[int], list[int], tuple | None]:
    """An offer's tokens and parents (a leading chain of at least two nodes; a tree unless it
    carries a window) and, where ``window``, a Jacobi window's tokens."""
    n = int(rng.integers(2, 12))
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    parents[1] = 0  # a leading chain of at least two nodes
    if not window:
        parents[-1] = n - 3 if n > 3 else -1  # off the chain: a tree, not a chain
    ahead = tuple(rng.integers(0, vocab, WINDOW_NODES).tolist()) if window else None
    return rng.integers(0, vocab, n).tolist(), parents, ahead


def _handed_out(offers: dict[str, tuple[list[int], list[int], tuple | None]]):
    """What the proposer hands tree verification (a ``StepDrafts``) for these offers."""
    from lookahead_vllm.core.tree_plan import StepDrafts, TreeOffers

    width = max([1, *(len(t) for t, _, _ in offers.values())])
    count = len(offers)
    tokens, parents = np.zeros((count, width), np.int32), np.full((count, width), -1, np.int32)
    for d, (tok, par, _) in enumerate(offers.values()):
        tokens[d, :len(tok)], parents[d, :len(par)] = tok, par
    lengths = np.fromiter((len(t) for t, _, _ in offers.values()), np.int64, count)
    rows = {req_id: d for d, req_id in enumerate(offers)}
    windows = {d: ahead for d, (_, _, ahead) in enumerate(offers.values()) if ahead is not None}
    return StepDrafts(TreeOffers(np.arange(count), tokens, parents, np.full((count, width), 0.5),
                                 np.zeros((count, width), np.int8), lengths, np.ones(count, bool)),
                      rows, windows, WINDOW, NGRAM)


def _random_plan(rng: np.random.Generator, vocab: int, window: bool) -> StepPlan:
    return step_plan(_handed_out({"x": _random_offer(rng, vocab, window)}), "x")


def _step(seed: int, vocab: int = 64):
    """A runner, scheduler output and logits for ~12 requests: trees (greedy, sampled, one
    only verifying its leading chain, some with a window) and chain requests between them."""
    from vllm import SamplingParams

    from lookahead_vllm.vllm.tree_verify import TreeVerifier

    rng = np.random.default_rng(seed)
    kinds = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.9, top_k=20),
             "chain_only": SamplingParams(temperature=0.0, presence_penalty=0.5)}
    offers, drafts, states, num_tokens = {}, {}, {}, []
    for i in range(12):
        req_id = f"r{i}"
        kind = ["greedy", "sampled", "chain_only", "chain"][int(rng.integers(4))]
        if kind == "chain":  # a request vLLM verifies as a chain: rows between the trees
            drafts[req_id] = rng.integers(0, vocab, int(rng.integers(1, 5))).tolist()
            states[req_id] = SimpleNamespace(sampling_params=kinds["greedy"])
        else:
            offers[req_id] = _random_offer(rng, vocab, window=kind != "chain_only" and rng.random() < 0.5)
            tok, _, ahead = offers[req_id]
            drafts[req_id] = tok + list(ahead or ())
            if rng.random() < 0.3:  # the scheduler's budget cut it (a window cut part way is not read)
                drafts[req_id] = drafts[req_id][:int(rng.integers(2, len(drafts[req_id]) + 1))]
            states[req_id] = SimpleNamespace(sampling_params=kinds[kind])
        num_tokens.append(len(drafts[req_id]) + 1)
    handed_out = _handed_out(offers)
    plans = {r: p.truncate(len(drafts[r])) for r, p in step_plans(handed_out).items()}
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
        drafter=SimpleNamespace(handed_out=handed_out, config=cfg, on_tree_truncated=lambda n: None,
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
    from lookahead_vllm.vllm.tree_verify import SAMPLING_EPS, tree_verifiable

    positions, sampled = runner.positions.clone(), sampled.clone()
    starts = np.cumsum(num_tokens) - num_tokens
    cu = np.cumsum(num_tokens)
    generators = {i: torch.Generator().manual_seed(seed * 100 + i) for i in range(len(num_tokens))}
    results = []
    for req_id, row in runner.input_batch.req_id_to_index.items():
        plan = step_plan(runner.drafter.handed_out, req_id)
        if plan is None:
            continue
        plan = plan.truncate(int(num_tokens[row]) - 1)  # what the scheduler kept
        if plan.is_chain():
            continue
        start, n = int(starts[row]), plan.num_nodes + 1
        positions[start:start + n] = positions[start] + torch.from_numpy(plan.position_offsets())
        rows = logits[cu[row] - n:cu[row]]
        sp = runner.requests[req_id].sampling_params
        if not tree_verifiable(sp):  # the stock chain result cut to the leading chain
            tokens = [t for t in sampled[row].tolist() if t >= 0]
            keep = min(len(tokens) - 1, plan.chain_prefix_length())
            nodes, tokens = list(range(keep)), tokens[:keep + 1]
        elif sp.temperature < SAMPLING_EPS:
            nodes, tokens = walk_tree(plan, rows.argmax(dim=-1).tolist().__getitem__)
        else:
            nodes, tokens = walk_tree(plan, lambda i: sample_row(rows[i], sp.temperature, sp.top_k, sp.top_p,
                                                                 generators[row]))
        sampled[row] = torch.tensor(tokens + [-1] * (sampled.shape[1] - len(tokens)), dtype=sampled.dtype)
        window = None
        if plan.has_lookahead and plan.num_nodes - plan.verify_nodes == WINDOW_NODES:  # the whole window
            base = plan.lookahead.index(True)
            window = rows[[0 if c < 0 else 1 + base + c for c in output_nodes(WINDOW, NGRAM)]].argmax(-1).tolist()
        results.append((req_id, plan.num_nodes, nodes, window))
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
    assert tree_result_rows(results[0]) == expected
    assert torch.equal(out.sampled_token_ids, expected_sampled)


@pytest.mark.parametrize("seed", range(4))
def test_the_argmax_greedy_sample_took_is_read_not_taken_again(seed, monkeypatch):
    """Where the step was sampled from one argmax over all its logits rows (the output carries
    it: ``patches.greedy_sample``), ``finish_step`` reads the tree rows' targets from it and
    takes no argmax of its own: the same rows as the reference; and the rows follow the argmax
    handed over, not the logits (one that differs gives other walks)."""
    from lookahead_vllm.ops.sampling import row_argmax
    from lookahead_vllm.vllm import tree_verify

    taken = []
    monkeypatch.setattr(tree_verify, "row_argmax", lambda rows: taken.append(len(rows)) or row_argmax(rows))

    def finish(logits_argmax):
        verifier, runner, sched, num_tokens, logits, spec, sampled, results = _step(seed)
        verifier.begin_step(runner, sched, num_tokens)
        out = SimpleNamespace(sampled_token_ids=sampled, logits_argmax=logits_argmax(logits))
        verifier.finish_step(runner, logits, spec, out)
        return out.sampled_token_ids, tree_result_rows(results[0])

    _, runner, _, num_tokens, logits, _, sampled, _ = _step(seed)
    _, expected_sampled, expected = _reference(runner, num_tokens, logits, sampled, seed)
    got_sampled, got = finish(lambda logits: logits.argmax(dim=-1).numpy())
    assert taken == [] and got == expected and torch.equal(got_sampled, expected_sampled)
    assert finish(lambda logits: None)[1] == expected and len(taken) == 1  # none handed over: its own
    other = finish(lambda logits: (logits.argmax(dim=-1).numpy() + 1) % logits.shape[1])
    assert other[1] != expected and len(taken) == 1


@pytest.mark.parametrize("seed", range(4))
def test_compaction_moves_each_accepted_node_to_its_depths_row(seed, monkeypatch):
    """Compaction gets, per tree, every accepted node off its depth's row: its row among the
    step's tokens (root + 1 + node) to the row of its depth (root + 1 + j), as a request-by-request
    pass lists them."""
    from lookahead_vllm.vllm import tree_verify

    verifier, runner, sched, num_tokens, logits, spec, sampled, _ = _step(seed)
    reference = _reference(runner, num_tokens, logits, sampled, seed)[2]
    runner.drafter.config.profile.debug_disable = ()
    moved = []
    monkeypatch.setattr(tree_verify, "_compact", lambda step, src, dst: moved.append((src.tolist(), dst.tolist())))
    verifier.begin_step(runner, sched, num_tokens)
    verifier.finish_step(runner, logits, spec, SimpleNamespace(sampled_token_ids=sampled))
    starts = np.cumsum(num_tokens) - num_tokens
    rows = runner.input_batch.req_id_to_index
    expected = [(int(starts[rows[r]]) + 1 + node, int(starts[rows[r]]) + 1 + j)
                for r, _, nodes, _ in reference for j, node in enumerate(nodes) if node != j]
    assert expected, "the step must accept a node off its depth's row"
    assert moved == [([s for s, _ in expected], [d for _, d in expected])]


def test_the_steps_above_hold_windows_and_cut_trees():
    """The steps ``test_batched_host_work_equals_request_by_request`` checks hold trees with their
    whole window read, windows the scheduler cut part way, and cut trees without a window."""
    seen = set()
    for seed in range(12):
        _, runner, _, num_tokens, logits, _, sampled, _ = _step(seed)
        handed_out = runner.drafter.handed_out
        for req_id, num_nodes, _, window in _reference(runner, num_tokens, logits, sampled, seed)[2]:
            plan = step_plan(handed_out, req_id)
            seen.add(("window read" if window is not None else "no window read",
                      "whole" if num_nodes == plan.num_nodes else "cut", "windowed" if plan.has_lookahead else "tree"))
    assert {("window read", "whole", "windowed"), ("no window read", "cut", "windowed"),
            ("no window read", "cut", "tree"), ("no window read", "whole", "tree")} <= seen, seen


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

    def paths(plan: StepPlan):
        return _uncovered_paths(list(plan.tree.parents), plan.chain_prefix_length())

    rng = np.random.default_rng(seed)
    plan = _random_plan(rng, 50, window=bool(seed % 2))
    if seed % 3 == 0:  # any parent-first tree, not only the shapes above
        n = int(rng.integers(1, 20))
        parents = tuple(int(rng.integers(-1, i)) for i in range(n))
        plan = StepPlan(DraftTree(tuple(range(n)), parents, (1.0,) * n))
    for k in (plan.num_nodes, max(1, plan.num_nodes - 3)):
        cut = plan.truncate(k)
        assert paths(cut) == _uncovered_paths_reference(cut)


@pytest.mark.parametrize("seed", range(20))
def test_tree_batch_rows_equal_each_requests_cut_plan(seed):
    """``StepDrafts.batch`` lays every request's plan, cut to what the scheduler kept, into rows
    of arrays: each row equals the request's ``StepPlan`` truncated (tokens, parents, lookahead
    nodes), with its depths, leading chain, chain-ness and visibility."""
    rng = np.random.default_rng(seed)
    offers = {f"r{i}": _random_offer(rng, 50, window=bool(rng.random() < 0.4)) for i in range(9)}
    handed_out = _handed_out(offers)
    ids = [r for r in offers if rng.random() < 0.8] or ["r0"]
    plans = [step_plan(handed_out, r) for r in ids]
    counts = np.array([int(rng.integers(1, p.num_nodes + 3)) for p in plans])  # cut, whole, or more
    trees, full = handed_out.batch(ids, counts)
    assert full.tolist() == [p.num_nodes for p in plans]
    depths, prefix, chains = trees.depths(), trees.chain_prefix(), trees.is_chain()
    size = int(trees.lengths.max()) + 2
    vis = trees.visibility(size)
    for t, (plan, k) in enumerate(zip(plans, counts.tolist())):
        cut = plan.truncate(k)
        got = batch_plan(trees, t)
        n = cut.num_nodes
        flags = (got.lookahead or (False,) * n, cut.lookahead or (False,) * n)  # () and all-False: no window
        assert (got.tree.tokens, got.tree.parents, flags[0]) == (cut.tree.tokens, cut.tree.parents, flags[1])
        assert depths[t, :n].tolist() == list(cut.tree.depths) and not depths[t, n:].any()
        assert prefix[t] == cut.chain_prefix_length() and chains[t] == cut.is_chain()
        want = np.zeros((size, size), bool)
        want[:n + 1, :n + 1] = cut.visibility()
        assert np.array_equal(vis[t], want)
    assert not chains.all() and (counts < full).any()  # the cases are not vacuous


@pytest.mark.parametrize("seed", range(8))
def test_begin_step_keeps_the_trees_a_request_by_request_pass_keeps(seed):
    """With the scheduler cutting some trees (to a chain or a smaller tree), some drafts
    differing from their plans (a token, or one token more than the plan), and a request not
    decoding this step, ``begin_step`` keeps exactly the trees the request-by-request rule
    keeps (cut plan not a chain, drafts equal to it, one decode row and the plan's), counts
    the cut ones and the mismatches, places each kept tree at its request's batch row and
    root, and gives its rows root + depth positions."""
    from vllm import SamplingParams

    from lookahead_vllm.vllm.tree_verify import TreeVerifier

    rng = np.random.default_rng(seed)
    offers = {f"r{i}": _random_offer(rng, 40, window=bool(rng.random() < 0.3)) for i in range(10)}
    handed_out = _handed_out(offers)
    drafts = {}
    for req_id, (tok, _, ahead) in offers.items():
        draft = tok + list(ahead or ())
        whole = req_id in ("r3", "r6", "r7")
        cut = int(rng.integers(1, len(draft) + 1)) if rng.random() < 0.4 and not whole else len(draft)
        draft = draft[:len(draft) - 1 if req_id == "r2" else cut]  # r2: always cut
        if (rng.random() < 0.2 and not whole) or req_id == "r3":  # r3: one token not the plan's
            draft[int(rng.integers(len(draft)))] += 1000
        drafts[req_id] = draft + [7] if req_id == "r6" else draft  # r6: one token more than its plan
    drafts["chain"] = [1, 2]  # a request with no plan (a chain draft)
    num_tokens = np.array([len(d) + 1 + (r == "r7") for r, d in drafts.items()], np.int32)  # r7: not a decode row
    starts = np.cumsum(num_tokens) - num_tokens
    cut_count = []
    greedy = SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))
    cfg = SimpleNamespace(profile=SimpleNamespace(debug_disable=()))
    positions = torch.arange(int(num_tokens.sum()), dtype=torch.int64) * 5 + 2
    runner = SimpleNamespace(
        drafter=SimpleNamespace(handed_out=handed_out, config=cfg, on_tree_truncated=cut_count.append),
        requests=dict.fromkeys(drafts, greedy), positions=positions.clone(),
        input_batch=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(drafts)}))
    verifier = TreeVerifier()
    verifier.begin_step(runner, SimpleNamespace(scheduled_spec_decode_tokens=drafts), num_tokens)
    kept, truncated, mismatched = [], 0, 0
    for i, (req_id, draft) in enumerate(drafts.items()):
        plan = step_plan(handed_out, req_id)
        if plan is None:
            continue
        truncated += len(draft) < plan.num_nodes
        cut = plan.truncate(len(draft))
        if cut.is_chain():
            continue
        if tuple(draft) != cut.tree.tokens:
            mismatched += 1
            continue
        if num_tokens[i] != cut.num_nodes + 1:
            continue
        start = int(starts[i])
        kept.append((req_id, i, start, cut.tree.tokens, cut.tree.parents))
        positions[start:start + cut.num_nodes + 1] = positions[start] + torch.from_numpy(cut.position_offsets())
    step = verifier.current
    got = [] if step is None else [
        (r, row, start, batch_plan(step.trees, t).tree.tokens, batch_plan(step.trees, t).tree.parents)
        for t, (r, row, start) in enumerate(zip(step.req_ids, step.rows.tolist(), step.starts.tolist()))]
    assert got == kept
    assert sum(cut_count) == truncated and verifier.plan_mismatches == mismatched
    assert torch.equal(runner.positions, positions)
    assert kept and truncated and mismatched >= 2  # the cases are not vacuous (r3 and r6 at least)
    assert "r7" not in [k[0] for k in kept] and "r7" in offers
