"""Configuration (public fields, profile, resolved settings) and DraftTree layout."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import dataclasses

from lookahead_lab.reference.planner import best_chain, best_path_tree
from lookahead_vllm.core import LookaheadConfig
from lookahead_lab.reference.trees import DraftTree
from lookahead_vllm.core.config import (DEFAULT_DECODING_LENGTH, PLATFORM_VALUES, PROFILE_KEY, PUBLIC_FIELDS, Profile,
                                        Settings, resolve)
from lookahead_vllm.core.draft_index import DraftIndexConfig
from tests.settings import lookahead_settings


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("decoding_length", 0, r"decoding_length=0: must be an integer in \[1, 256\]"),
        ("decoding_length", 1.5, r"decoding_length=1.5: must be an integer in \[1, 256\]"),
        ("decoding_length", True, r"decoding_length=True: must be an integer"),
        ("draft_shape", "tree", r"draft_shape='tree': must be one of \('hier', 'par', 'one'\)"),
        ("source", "suffix", r"source='suffix': must be one of \('index', 'trie', 'jacobi', 'both'"),
        ("draft_sharing", "some", r"draft_sharing='some': must be one of \('per-salt', 'per-salt-saved', 'all', 'none'\)"),
        ("index_corpus_bytes", -1, r"index_corpus_bytes=-1: must be an integer in \[0, 1099511627776\]"),
        ("warm_start", 3, r"warm_start=3: must be a file path"),
        ("cost_free_tokens", -2, r"cost_free_tokens=-2: must be an integer in \[-1, 65536\] \(-1: measured online\)"),
        ("cost_marginal_tokens", 0.5, r"cost_marginal_tokens=0.5: must be -1 \(measured online\) or in \[1, 1e\+06\]"),
        ("cost_marginal_tokens", "7", r"cost_marginal_tokens='7': must be a number in \[-1, 1e\+06\]"),
    ],
)
def test_invalid_fields_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        LookaheadConfig(**{field: value})
    with pytest.raises(ValueError, match=message):  # the same through resolve (the engine's path)
        resolve({field: value})


def test_public_fields_are_few_and_the_schema_is_closed():
    schema = LookaheadConfig.model_json_schema()
    assert len(schema["properties"]) <= 10, sorted(schema["properties"])
    assert schema["additionalProperties"] is False
    assert PROFILE_KEY not in schema["properties"]
    from lookahead_vllm.core.request_options import MAX_CAP  # a request's cap: up to decoding_length's maximum

    assert schema["properties"]["decoding_length"]["anyOf"][0]["maximum"] == MAX_CAP
    assert set(schema["properties"]) == set(PUBLIC_FIELDS)
    assert {"source", "draft_shape", "decoding_length", "index_corpus_bytes", "warm_start", "snapshot_path",
            "draft_sharing"} <= set(PUBLIC_FIELDS)
    # Settings carries every public field (decoding_length resolved) and the profile.
    assert {f.name for f in dataclasses.fields(Settings)} == set(PUBLIC_FIELDS) | {"profile"}


def test_unknown_fields_rejected_by_name():
    with pytest.raises(ValueError, match=r"unknown lookahead field\(s\) \['decoding_len'\]; the fields are \['source'"):
        LookaheadConfig(decoding_len=4)


@pytest.mark.parametrize("name, message", [
    ("index_corpus_tokens", r"index_corpus_tokens: no longer a lookahead field; renamed; use index_corpus_bytes"),
    ("index_upkeep", r"index_upkeep: no longer a lookahead field; internal now \(the platform profile's upkeep_thread"),
    ("cost_per_path", r"cost_per_path: no longer a lookahead field; internal now"),
    ("insert_output", r"insert_output: no longer a lookahead field; removed \(it was never read"),
    ("branch_length", r"branch_length: no longer a lookahead field; it is internal now \(a tuning knob of the "
                      r"platform profile, docs/configuration.md 'Developer settings'\)"),
    ("jacobi_window", r"jacobi_window: no longer a lookahead field; it is internal now"),
])
def test_retired_fields_name_their_replacement(name, message):
    with pytest.raises(ValueError, match=message):
        resolve({name: 1})


def test_profile_has_one_set_of_defaults_and_per_platform_values():
    cpu, gpu = resolve(platform="cpu").profile, resolve(platform="gpu").profile
    differ = {f.name for f in dataclasses.fields(Profile) if getattr(cpu, f.name) != getattr(gpu, f.name)}
    assert differ == set(PLATFORM_VALUES["cpu"]) == set(PLATFORM_VALUES["gpu"])
    assert (cpu.upkeep_thread, gpu.upkeep_thread) == (False, True)
    assert (cpu.load_shrink_above, cpu.load_stop_at, gpu.load_shrink_above, gpu.load_stop_at) == (16, 64, 32, 128)
    with pytest.raises(TypeError):  # the per-platform knobs have no default outside PLATFORM_VALUES
        Profile()


def test_a_retired_knob_and_an_unknown_platform_are_named():
    from lookahead_vllm.core.config import default_decoding_length

    with pytest.raises(ValueError, match=r"_profile: unknown knob\(s\) \['draftless_graphs'\]; the knobs are \["):
        resolve({PROFILE_KEY: {"draftless_graphs": True}})
    with pytest.raises(ValueError, match=r"platform='tpu': must be one of \('cpu', 'gpu'\)"):
        default_decoding_length("tpu")
    assert default_decoding_length("cpu") == resolve(platform="cpu").decoding_length


@pytest.mark.parametrize("profile, message", [
    ({"debug_disable": 5}, r"_profile.debug_disable=5: a list drawn from \('positions', 'mask', 'compaction'\)"),
    ({"debug_disable": "mask"}, r"_profile.debug_disable='mask': a list drawn from"),  # not split into letters
    ({"debug_disable": ["mask", "cache"]}, r"_profile.debug_disable=\['mask', 'cache'\]: a list drawn from"),
    ({"platform": "gpu"}, r"_profile.platform='gpu': this engine runs on 'cpu'"),
    ([], r"_profile must be a mapping of profile knobs, got list"),
    (0, r"_profile must be a mapping of profile knobs, got int"),
])
def test_a_bad_profile_is_named_with_its_value(profile, message):
    with pytest.raises(ValueError, match=message):
        resolve({PROFILE_KEY: profile}, platform="cpu")
    assert resolve({PROFILE_KEY: {"debug_disable": ["mask"]}}).profile.debug_disable == ("mask",)
    assert resolve({PROFILE_KEY: None}).profile == resolve().profile


def test_profile_overrides_are_explicit_and_checked():
    s = resolve({"source": "trie", PROFILE_KEY: {"branch_length": 8, "upkeep_thread": True}})
    assert (s.profile.branch_length, s.profile.upkeep_thread, s.profile.max_match_length) == (8, True, 6)
    with pytest.raises(ValueError, match=r"_profile.branch_length=1: must be an integer in \[2, 128\]"):
        resolve({PROFILE_KEY: {"branch_length": 1}})
    with pytest.raises(ValueError, match=r"_profile.max_match_length=12: must be in \[1, 11\]"):
        resolve({PROFILE_KEY: {"max_match_length": 12}})
    with pytest.raises(ValueError, match=r"_profile.load_stop_at=4: must be in \[17, 65537\]"):
        resolve({PROFILE_KEY: {"load_stop_at": 4}})
    with pytest.raises(ValueError, match=r"_profile.insert_prompt='yes': must be true or false"):
        resolve({PROFILE_KEY: {"insert_prompt": "yes"}})
    with pytest.raises(ValueError, match=r"_profile: unknown knob\(s\) \['branch_len'\]"):
        resolve({PROFILE_KEY: {"branch_len": 4}})


def test_decoding_length_resolved_against_the_engines_draft_slots():
    assert resolve().decoding_length == DEFAULT_DECODING_LENGTH == 16
    assert resolve(platform="gpu").decoding_length == 8  # every GPU step is filled to k: k is its price
    with pytest.raises(ValueError, match="platform='tpu'"):
        resolve(platform="tpu")
    assert resolve(num_speculative_tokens=8).decoding_length == 8
    assert resolve({"source": "both"}, num_speculative_tokens=16).decoding_length == 16 - 7  # W=4, N=3 window
    with pytest.raises(ValueError, match=r"decoding_length=9: must be <= speculative_config.num_speculative_tokens=8"):
        resolve({"decoding_length": 9}, num_speculative_tokens=8)
    with pytest.raises(ValueError, match=r"the step needs \(W \+ G\) \* \(N - 1\) - 1 = 15 draft slots"):
        resolve({"source": "jacobi"}, num_speculative_tokens=8)


def test_settings_carried_to_the_workers_unchanged():
    import json

    s = resolve({"draft_shape": "hier", PROFILE_KEY: {"debug_disable": ["mask"]}}, platform="gpu",
                num_speculative_tokens=12)
    carried = json.loads(json.dumps(s.to_carried()))  # inside vLLM's additional_config, hashed as JSON
    assert Settings.from_carried(carried) == s
    assert resolve(carried, platform="gpu", num_speculative_tokens=12) == s  # resolving it again: the same
    with pytest.raises(ValueError, match=r"not resolved where the engine config was built"):
        Settings.from_carried({"draft_shape": "hier"})


def test_corpus_cap_is_split_between_the_index_and_its_backoff():
    cfg = resolve({"index_corpus_bytes": 1000})
    assert [cfg.index_config().corpus_bytes, cfg.index_config(1).corpus_bytes] == [500, 500]
    assert resolve({"index_corpus_bytes": 1000, PROFILE_KEY: {"index_backoff": 0}}).index_config().corpus_bytes == 1000
    assert cfg.index_config() == DraftIndexConfig(2, 64, 32, 16, 500)  # built from the profile


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
    assert best_chain(tree) == [on, a, table]
    assert tree.path_to(5) == [0, 4, 5]
    conf = DraftTree(tree.tokens, tree.parents, (1, 5, 1, 4, 2, 1), (0.9, 0.5, 0.2, 0.3, 0.4, 0.1))
    chain = best_path_tree(conf)  # on (1) -> a (5) -> chair (4): confidences follow their nodes
    assert (chain.tokens, chain.parents, chain.confidence) == ((on, a, chair), (-1, 0, 1), (0.9, 0.5, 0.3))
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
    from lookahead_lab.reference.planner import allocate_step_budget

    assert allocate_step_budget([[0.9, 0.5, 0.2], [0.8, 0.7]], 3) == [1, 2]
    assert allocate_step_budget([[0.9, 0.5], [0.8]], 10) == [2, 1]
    assert allocate_step_budget([[], [0.3]], 0) == [0, 0]


def test_step_budget_properties():
    import random

    from lookahead_lab.reference.planner import allocate_step_budget

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


def test_forward_cost_model():
    from lookahead_vllm.core.budget import ForwardCost

    cost = ForwardCost(free_tokens=12, marginal_tokens=18)
    assert cost(1) == cost(12) == 1.0
    assert cost(30) == pytest.approx(2.0)
    assert ForwardCost(0, 1.0)(500) == 1.0  # off: every token free
    assert ForwardCost(12, 18, per_path=0.1)(30, paths=2) == pytest.approx(2.2)
    # A fixed cost for a step that runs any extra path at all, then per path.
    with_setup = ForwardCost(12, 18, per_path=0.02, path_setup=0.09)
    assert with_setup(9, paths=0) == 1.0 and with_setup(9, paths=1) == pytest.approx(1.11)
    assert with_setup(9, paths=3) == pytest.approx(1.15)


def test_forward_cost_platform_defaults_and_overrides():
    from lookahead_vllm.core.budget import ForwardCost, forward_cost

    default = resolve()
    assert (default.cost_free_tokens, default.cost_marginal_tokens) == (-1, -1.0)
    assert forward_cost(default, paths=False) == ForwardCost(5, 20.0, draft_setup=0.05, per_row=0.04, per_context=0.08)
    assert forward_cost(default, paths=False).drafted(6) == pytest.approx(1.1)  # 1 + 1/20 + the setup
    gpu = forward_cost(resolve(platform="gpu"))
    assert (gpu.free_tokens, gpu.marginal_tokens, gpu.per_path) == (32, 675.0, 0.0) and gpu(32) == 1.0 < gpu(33)
    # Trees on the CPU pay its path rounds (the profile's path_setup, cost_per_path).
    assert forward_cost(default) == ForwardCost(5, 20.0, per_path=0.02, path_setup=0.09, draft_setup=0.05,
                                                per_row=0.04, per_context=0.08)
    mine = resolve({"cost_free_tokens": 0, "cost_marginal_tokens": 7, PROFILE_KEY: {"cost_per_path": 0.5}},
                   platform="gpu")
    assert forward_cost(mine) == ForwardCost(0, 7, per_path=0.5, path_setup=0.0)
    assert forward_cost(mine)(1000, paths=3) == 1.0  # cost_free_tokens=0: the model is off


def test_a_row_that_cannot_pay_its_entry_at_the_steps_rate_keeps_nothing():
    """Entries (what a drafted row's context costs): two rows with the same
    draft, the second's entry 10x the first's. At the draftless rate (2
    tokens a forward) the second row's 1.2 expected tokens pay its 0.5
    forwards, and the plan with both reaches 2.51 tokens a forward; at that
    rate they do not, and the plan without it reaches 2.91: that one stands."""
    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_lab.reference.planner import allocate_step_budget

    cost = ForwardCost(5, 20.0, draft_setup=0.05)
    confs = [[0.6, 0.4, 0.2], [0.6, 0.4, 0.2]]

    def rate(keep, entry):
        gained = sum(sum(c[:k]) for c, k in zip(confs, keep))
        fees = sum(e for e, k in zip(entry, keep) if k)
        return (2 + gained) / (cost.drafted(2 + sum(keep)) + fees)

    entry = [0.05, 0.5]
    assert 1.2 > 0.5 * 2 / cost(2) and rate([3, 3], entry) == pytest.approx(2.514, abs=1e-3)
    assert allocate_step_budget(confs, None, 2, cost, entry=entry) == [3, 0]
    assert rate([3, 0], entry) == pytest.approx(2.909, abs=1e-3)
    # Without entries both keep their drafts; with a small one as well; an
    # entry no draft can pay at the draftless rate empties its row at once.
    assert allocate_step_budget(confs, None, 2, cost) == [3, 3]
    assert allocate_step_budget(confs, None, 2, cost, entry=[0.05, 0.05]) == [3, 3]
    assert allocate_step_budget(confs, None, 2, cost, entry=[0.05, 0.6]) == [3, 0]


def test_cost_model_keeps_only_paying_draft_tokens():
    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_lab.reference.planner import allocate_step_budget

    cost = ForwardCost(free_tokens=12, marginal_tokens=18)
    # One request: 1 + 8 tokens fit in the free region, so everything is kept.
    assert allocate_step_budget([[0.9, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.01]], None, 1, cost) == [8]
    # Eight requests: 4 free slots, then a token pays only if its confidence
    # beats tokens-per-forward / marginal_tokens (about 0.75 here): the 0.95
    # and 0.9 positions do, the 0.3 ones do not.
    assert allocate_step_budget([[0.95, 0.9, 0.3, 0.1]] * 8, None, 8, cost) == [2] * 8
    # A low-confidence batch drafts nothing past the free region.
    assert sum(allocate_step_budget([[0.05] * 8] * 16, None, 16, cost)) == 0


def test_opens_path_marks_every_child_but_the_first():
    from lookahead_lab.reference.planner import opens_path

    # root -> 0 -> 1 -> 2, 0 -> 3, root -> 4 -> 5, 4 -> 6
    parents = [-1, 0, 1, 0, -1, 4, 4]
    assert opens_path(parents) == [False, False, False, True, True, False, True]
    # Leaves = 1 + paths opened (each extra child adds one leaf).
    tree = DraftTree(tokens=tuple(range(7)), parents=tuple(parents), weights=(1.0,) * 7)
    leaves = sum(1 for kids in tree.children()[:7] if not kids)
    assert leaves == 1 + sum(opens_path(parents))


def test_cost_model_prices_extra_tree_paths():
    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_lab.reference.planner import allocate_step_budget

    # Chain 0.9 -> 0.5, and a side branch of 0.2 from the root (a second path).
    confs, opens = [[0.9, 0.5, 0.2]], [[False, False, True]]
    # Without a path cost the side branch is free at batch 1: kept.
    assert allocate_step_budget(confs, None, 1, ForwardCost(12, 18), opens) == [3]
    # At 0.1 forwards a path it costs more than its 0.2 tokens bring: (2.6 / 1.1 < 2.4).
    assert allocate_step_budget(confs, None, 1, ForwardCost(12, 18, per_path=0.1), opens) == [2]
    # At 0.05 it pays (2.6 / 1.05 > 2.4).
    assert allocate_step_budget(confs, None, 1, ForwardCost(12, 18, per_path=0.05), opens) == [3]
    # Rounds are shared by the batch: a second request's side branch rides the same round.
    two = allocate_step_budget([[0.9, 0.2], [0.9, 0.2]], None, 2, ForwardCost(12, 18, per_path=0.1),
                               [[False, True], [False, True]])
    assert two == [2, 2]  # (2 + 1.8 + 0.4) / 1.1 > (2 + 1.8) / 1


def test_cost_model_picks_the_best_prefix_of_the_merged_order():
    import random

    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_lab.reference.planner import _merged_order, allocate_step_budget

    rng = random.Random(1)
    for _ in range(200):
        # Tree drafts in DFS order: confidences need not be monotone.
        confs = [[rng.uniform(0, 1) for _ in range(rng.randint(0, 8))] for _ in range(rng.randint(1, 12))]
        opens = [[rng.random() < 0.4 for _ in c] for c in confs]
        cost = ForwardCost(free_tokens=rng.randint(1, 16), marginal_tokens=rng.uniform(2, 30),
                           per_path=rng.choice([0.0, rng.uniform(0, 0.3)]), path_setup=rng.choice([0.0, 0.1]))
        rows = len(confs)
        keep = allocate_step_budget(confs, None, rows, cost, opens)

        def rate(prefix: list[int]) -> float:  # prefix length per request
            rounds = max(sum(o[:k]) for o, k in zip(opens, prefix))
            gain = rows + sum(sum(c[:k]) for c, k in zip(confs, prefix))
            return gain / cost(rows + sum(prefix), rounds)

        order = _merged_order(confs)
        rates = []
        for m in range(len(order) + 1):
            prefix = [0] * len(confs)
            for _, req in order[:m]:
                prefix[req] += 1
            rates.append(rate(prefix))
        assert rate(keep) == pytest.approx(max(rates))
        # Each request keeps a prefix, taken head-first from the merged order.
        counts = [0] * len(confs)
        for _, req in order[:sum(keep)]:
            counts[req] += 1
        assert counts == keep


def test_confidence_floor_scales_with_the_batch_only_without_the_cost_model():
    from lookahead_vllm.core.budget import MAX_CONFIDENCE_FLOOR, confidence_floor

    priced = lookahead_settings(min_draft_confidence=0.03)  # platform token prices: the model weighs the load
    assert [confidence_floor(priced, n) for n in (1, 8, 256)] == [0.03, 0.03, 0.03]
    assert confidence_floor(lookahead_settings(min_draft_confidence=0.03, cost_free_tokens=8), 8) == 0.03
    free = lookahead_settings(min_draft_confidence=0.03, cost_free_tokens=0)  # no cost model: the floor does
    assert confidence_floor(free, 1) == 0.03
    assert confidence_floor(free, 8) == pytest.approx(0.24)
    assert confidence_floor(free, 256) == MAX_CONFIDENCE_FLOOR
