"""LookaheadConfig validation and DraftTree layout."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from lookahead_vllm.core import DraftTree, LookaheadConfig


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("decoding_length", 0, r"decoding_length=0: must be in \[1, 256\]"),
        ("decoding_length", 1.5, r"decoding_length=1.5: must be an integer"),
        ("branch_length", 1, r"branch_length=1: must be in \[2, 128\]"),
        ("max_match_length", 12, r"max_match_length=12: must be in \[1, 11\]"),
        ("min_match_length", 9, r"min_match_length=9: must be in \[1, 6\]"),
        ("trie_capacity", 10, r"trie_capacity=10: must be in \[64, "),
        ("prompt_weight", -1.0, r"prompt_weight=-1.0: must be in \[0, 1e\+09\]"),
        ("min_draft_confidence", 1.5, r"min_draft_confidence=1.5: must be in \[0, 1\]"),
        ("draft_shape", "tree", r"draft_shape='tree': must be one of \('hier', 'par', 'one'\)"),
        ("insert_output", "yes", r"insert_output='yes': must be true or false"),
        ("min_retrieved_nodes", True, r"min_retrieved_nodes=True: must be an integer"),
    ],
)
def test_invalid_fields_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        LookaheadConfig(**{field: value})


def test_unknown_keys_rejected_by_name():
    with pytest.raises(ValueError, match=r"unknown lookahead config key\(s\) \['decoding_len'\]"):
        LookaheadConfig.from_dict({"decoding_len": 4})


def test_from_dict_roundtrip():
    cfg = LookaheadConfig.from_dict({"decoding_length": 4, "draft_shape": "hier"})
    assert LookaheadConfig.from_dict(cfg.to_dict()) == cfg


def test_core_does_not_import_torch_or_vllm():
    import subprocess

    code = "import sys, lookahead_vllm.core; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_draft_tree_layout_seed000_example():
    # root "sits"; branches on-my-knee, on-a-table, on-a-chair (ids 1..6)
    on, a, table, chair, my, knee = 1, 2, 3, 4, 5, 6
    tree = DraftTree((on, a, table, chair, my, knee), (-1, 0, 1, 1, 0, 4), (6, 5, 4, 3, 2, 1))
    assert tree.depths == (1, 2, 3, 3, 2, 3)
    mask = tree.ancestor_mask()
    assert mask[3].tolist() == [True, True, False, True, False, False]  # chair sees on, a, itself
    assert mask[5].tolist() == [True, False, False, False, True, True]
    assert tree.best_chain() == [on, a, table]
    assert tree.path_to(5) == [0, 4, 5]
    sub = tree.truncate(3)
    assert sub.parents == (-1, 0, 1)


def test_draft_tree_rejects_child_before_parent():
    with pytest.raises(ValueError, match=r"parents\[0\]=1"):
        DraftTree((1, 2), (1, -1), (1.0, 1.0))


def test_chain_tree():
    t = DraftTree.chain([4, 5, 6])
    assert t.depths == (1, 2, 3)
    assert np.array_equal(t.ancestor_mask(), np.tril(np.ones((3, 3), dtype=bool)))


def test_step_budget_keeps_most_confident_prefixes():
    from lookahead_vllm.core.budget import allocate_step_budget

    assert allocate_step_budget([[0.9, 0.5, 0.2], [0.8, 0.7]], 3) == [1, 2]
    assert allocate_step_budget([[0.9, 0.5], [0.8]], 10) == [2, 1]
    assert allocate_step_budget([[], [0.3]], 0) == [0, 0]


def test_step_budget_properties():
    import random

    from lookahead_vllm.core.budget import allocate_step_budget

    rng = random.Random(0)
    for _ in range(300):
        confs = []
        for _ in range(rng.randint(0, 6)):
            c, chain = 1.0, []
            for _ in range(rng.randint(0, 8)):
                c *= rng.uniform(0.1, 0.99)
                chain.append(c)
            confs.append(chain)
        budget = rng.randint(0, 20)
        keep = allocate_step_budget(confs, budget)
        assert sum(keep) == min(budget, sum(map(len, confs)))
        assert all(0 <= k <= len(c) for k, c in zip(keep, confs))
        kept = [c for k, chain in zip(keep, confs) for c in chain[:k]]
        dropped = [c for k, chain in zip(keep, confs) for c in chain[k:]]
        assert not kept or not dropped or min(kept) >= max(dropped)
