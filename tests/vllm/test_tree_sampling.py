"""Tree acceptance by sampling is exactly the target distribution (chi-square).

With deterministic drafts, walking the tree and sampling the target at every
reached row emits, at each position, a token drawn from the target's
distribution at that position given the emitted prefix, whatever the tree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lookahead_lab.reference.trees import DraftTree, StepPlan, batch_of_plans, walk_tree
from lookahead_vllm.ops.sampling import filtered_probs, sample_row
from lookahead_vllm.vllm import tree_verify

VOCAB = 6
TRIALS = 6000
# Rows: root, then nodes 0:t2(root) 1:t3(0) 2:t4(root) 3:t1(2). Tokens 2 and 4
# are drafted after the root, so the walk continues for them.
TREE = DraftTree(tokens=(2, 3, 4, 1), parents=(-1, 0, -1, 2), weights=(4, 3, 2, 1))


def _row_logits(seed: int) -> torch.Tensor:
    return torch.randn(1 + len(TREE), VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


# The walks: the reference's over a StepPlan, and tree verification's over the plan's TreeBatch row.
WALKS = {"reference": walk_tree,
         "verifier": lambda plan, target_at: tree_verify._walk(batch_of_plans([plan]), 0, target_at)}


@pytest.mark.parametrize("walk", sorted(WALKS))
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)])
def test_tree_walk_samples_match_target(walk, temperature, top_k, top_p):
    logits = _row_logits(1)
    probs = [filtered_probs(row, temperature, top_k, top_p).numpy() for row in logits]
    gen = torch.Generator().manual_seed(123)
    plan = StepPlan(TREE)
    first, second = [], {2: [], 4: []}
    for _ in range(TRIALS):
        nodes, tokens = WALKS[walk](plan, lambda r: sample_row(logits[r], temperature, top_k, top_p, gen))
        first.append(tokens[0])
        if tokens[0] in second:
            assert len(tokens) >= 2 and nodes[0] == TREE.tokens.index(tokens[0])
            second[tokens[0]].append(tokens[1])
        else:
            assert tokens == [tokens[0]] and nodes == []
    _assert_matches(first, probs[0])
    # After node 0 (token 2) the target row is row 1; after node 2 (token 4), row 3.
    _assert_matches(second[2], probs[1])
    _assert_matches(second[4], probs[3])


@pytest.mark.parametrize("seed", range(300))
def test_verifier_walk_equals_the_reference_walk(seed):
    """Tree verification's walk over a TreeBatch row accepts what the reference's walk over the
    StepPlan accepts, on random trees (siblings may share a token), with and without a Jacobi
    window (its lookahead nodes, last, never accepted), asking for the same rows in the same order."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    parents = tuple(int(rng.integers(-1, i)) for i in range(n))
    tokens = tuple(int(t) for t in rng.integers(0, 3, n))
    ahead = int(rng.integers(0, n)) if rng.random() < 0.5 else 0
    plan = StepPlan(DraftTree(tokens, parents, (1.0,) * n), (False,) * (n - ahead) + (True,) * ahead if ahead else ())
    targets = rng.integers(0, 3, n + 1).tolist()
    asked = {name: [] for name in WALKS}
    got = {name: walk(plan, lambda r, a=asked[name]: a.append(r) or targets[r]) for name, walk in WALKS.items()}
    assert got["verifier"] == got["reference"] and asked["verifier"] == asked["reference"]
    assert not set(got["verifier"][0]) & set(range(n - ahead, n))


def _assert_matches(samples: list[int], p: np.ndarray) -> None:
    assert len(samples) > 200, "too few samples to test"
    counts = np.bincount(samples, minlength=VOCAB)
    support = p > 0
    assert counts[~support].sum() == 0, "sampled a token the filters remove"
    if support.sum() == 1:
        return  # a single-token nucleus: checked above
    expected = p[support].astype(np.float64)
    expected *= counts[support].sum() / expected.sum()
    assert chisquare(counts[support], expected).pvalue > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    """The check above can fail: samples from another row are rejected."""
    logits = _row_logits(2)
    gen = torch.Generator().manual_seed(5)
    wrong = [sample_row(logits[1], 1.0, 0, 1.0, gen) for _ in range(TRIALS)]
    with pytest.raises(AssertionError):
        _assert_matches(wrong, filtered_probs(logits[0], 1.0, 0, 1.0).numpy())


def test_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert (filtered_probs(logits, 1.0, 2, 1.0) > 0).tolist() == [True, True, False, False, False]
    p = filtered_probs(logits, 1.0, 0, 0.7)  # softmax: .64 .23 .09 ...: nucleus {0, 1}
    assert (p > 0).tolist() == [True, True, False, False, False]
    assert torch.isclose(p.sum(), torch.tensor(1.0))
