"""Tree verification end to end: lossless greedy, and each piece proven necessary.

SmolLM2-135M-Instruct (fp32). Trees (``hier``/``par``) go through one forward
with tree positions and the tree mask; the accepted path's KV is compacted.
"""

from __future__ import annotations

import pytest

from lookahead_lab.offline import count_mismatches, generate
from lookahead_vllm.core.calibration import KIND_BRANCH, KIND_CHAIN

from .conftest import MAX_TOKENS, NUM_BS1_SHORT, plain_bs1_prefix, plain_run

pytestmark = pytest.mark.vllm


def _params(n: int, mixed: bool, **extra):
    """Greedy params. With ``mixed``, request 3j+1 turns lookahead off and
    request 3j+2 uses a repetition penalty (history along the draft: verified
    as a chain); the rest draft trees."""
    from vllm import SamplingParams

    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **extra)
    if not mixed:
        return [plain] * n
    off = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args={"lookahead_enabled": False}, **extra)
    penalised = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.2, **extra)
    return [(plain, off, penalised)[i % 3] for i in range(n)]


def _subset(prompts, dataset, n):
    """``prompts[dataset]``'s first ``n`` (all for None), or ``[lo:hi]`` for ``n = (lo, hi)``; and its plain_run key."""
    if isinstance(n, tuple):
        return prompts[dataset][n[0]:n[1]], f"{dataset}[{n[0]}:{n[1]}]"
    return prompts[dataset][:n], dataset if n is None else f"{dataset}[:{n}]"


def _plain(engines, prompts, dataset, bs, mixed, n=None):
    ps, key = _subset(prompts, dataset, n)
    # Unmixed greedy is the same run as test_greedy_identity's (shared).
    return plain_run(engines, ps, _params(len(ps), mixed), bs, (key, "mixed" if mixed else "greedy"))


def _tree_engine(engines, shape: str, **extra):
    # The trie's trees: wide (many side branches, leading chain of kind
    # "chain"), so every piece of tree verification and calibration is hit.
    # Tree verification itself does not depend on the draft source.
    extra.setdefault("source", "trie")
    name = f"lookahead-tree-{shape}-" + "-".join(f"{k}{v}" for k, v in sorted(extra.items()))
    return engines.get(name, lookahead={"draft_shape": shape, **extra})


@pytest.mark.parametrize(
    "shape,dataset,n,bs,mixed",
    [
        # bs 1 on the first NUM_BS1_SHORT HumanEval prompts (held to the
        # first outputs of the bs-1 plain run test_greedy_identity and
        # test_jacobi share).
        ("hier", "humaneval", NUM_BS1_SHORT, 1, False),
        # Slow (~70 s each): the same check as the default bs-1 case on all
        # prompts of either dataset.
        pytest.param("hier", "humaneval", None, 1, False, marks=pytest.mark.slow),
        pytest.param("hier", "mtbench", None, 1, False, marks=pytest.mark.slow),
        # bs 8: one batch of 8 HumanEval prompts, mixed (one mixed plain run
        # shared by both shapes): prompts 5-12, which the bs-1 case did not
        # run (on prompts the trie has seen whole, every accept is on the
        # leading chain); the counters below show trees, side branches and
        # off-chain accepts were verified.
        pytest.param("hier", "humaneval", (5, 13), 8, True, id="hier-humaneval[5:13]-8-True"),
        # Slow: the same check on all 20 HumanEval prompts (3 batches).
        pytest.param("hier", "humaneval", None, 8, True, marks=pytest.mark.slow),
        # Slow (~40 s): the same check as (hier, humaneval, bs 8, mixed) on the
        # second dataset; par keeps a second tree shape at bs 8 in the default suite.
        pytest.param("hier", "mtbench", None, 8, True, marks=pytest.mark.slow),
        pytest.param("par", "humaneval", (5, 13), 8, True, id="par-humaneval[5:13]-8-True"),
    ],
)
def test_tree_greedy_identical_to_plain(engines, prompts, shape, dataset, n, bs, mixed):
    from lookahead_lab.offline import find_proposers

    # Side branches go out at every batch size: the forward-cost model (which
    # prices tokens and each extra path on the CPU and at batch 8 keeps few
    # side branches; unit-tested) is off here.
    llm = _tree_engine(engines, shape, cost_free_tokens=0)
    (proposer,) = find_proposers(llm)
    before = proposer.stats.counters()
    cal = proposer.calibrator
    seen_before, accepted_before = cal.nodes.copy(), cal.accepted.sum()
    ps, _ = _subset(prompts, dataset, n)
    ours = generate(llm, ps, _params(len(ps), mixed), bs)
    if bs == 1 and n == NUM_BS1_SHORT and not mixed:
        plain_ids = plain_bs1_prefix(engines, prompts[dataset], _params(1, False)[0], n, dataset)
    else:
        plain_ids = _plain(engines, prompts, dataset, bs, mixed, n).token_ids
    assert count_mismatches(plain_ids, ours.token_ids) == 0
    after = proposer.stats.counters()
    # Trees were really verified, and some accepted node was off the leading
    # chain: something chain verification cannot produce.
    assert after["tree_request_steps"] > before["tree_request_steps"]
    assert after["tree_off_chain_accepts"] > before["tree_off_chain_accepts"]
    # The calibrator learned from the verified trees, side branches included
    # (the scheduled drafts reach the proposer).
    seen = cal.nodes - seen_before
    assert seen[KIND_CHAIN].sum() > 0 and seen[KIND_BRANCH].sum() > 0
    assert 0 < cal.accepted.sum() - accepted_before < seen.sum()


def test_index_trees_greedy_identical_to_plain(engines, prompts):
    """The draft index's trees (the default source, through the planner,
    core/tree_plan.py) verify losslessly, side branches accepted, at bs 8 with
    mixed sampling (greedy rows verify trees, sampled ones too)."""
    from lookahead_lab.offline import find_proposers

    # The engine test_plan_mismatch and test_sampling share (conftest.SHARED_ENGINES).
    llm = engines.get("lookahead-hier-cost0", lookahead={"draft_shape": "hier", "cost_free_tokens": 0})
    (proposer,) = find_proposers(llm)
    assert proposer.tree_mode
    before = proposer.stats.counters()
    ps, _ = _subset(prompts, "humaneval", (5, 13))
    ours = generate(llm, ps, _params(len(ps), True), 8)
    assert count_mismatches(_plain(engines, prompts, "humaneval", 8, True, (5, 13)).token_ids, ours.token_ids) == 0
    after = proposer.stats.counters()
    assert after["tree_request_steps"] > before["tree_request_steps"]
    assert after["tree_off_chain_accepts"] > before["tree_off_chain_accepts"]
    assert proposer.calibrator.nodes[KIND_BRANCH].sum() > 0


@pytest.mark.parametrize("switch", ["positions", "mask", "compaction"])
def test_each_piece_is_needed(engines, prompts, switch):
    """Negative controls: switching off one piece must break greedy identity.

    The switch goes on the module's tree engine for this test only: the
    profile's ``debug_disable``, which ``TreeVerifier.begin_step`` reads from
    the proposer's settings on every step, is swapped in (the same engine
    otherwise, no engine built per switch) and put back after; the prefix
    cache is reset so that no KV block written without the piece is reused.
    """
    import dataclasses

    from lookahead_lab.offline import find_proposers

    subset = prompts["humaneval"][:8]
    plain = _plain(engines, prompts, "humaneval", 8, False, 8)
    # Full trees at batch 8 (the forward-cost model off), so every piece is exercised.
    llm = _tree_engine(engines, "hier", cost_free_tokens=0)
    (proposer,) = find_proposers(llm)
    settings = proposer.config
    proposer.config = dataclasses.replace(
        settings, profile=dataclasses.replace(settings.profile, debug_disable=(switch,)))
    before = proposer.stats.counters()["tree_request_steps"]
    try:
        ours = generate(llm, subset, _params(len(subset), False), 8)
    finally:
        proposer.config = settings
        assert llm.reset_prefix_cache()
    assert proposer.stats.counters()["tree_request_steps"] > before, "no tree was verified"
    assert count_mismatches(plain.token_ids, ours.token_ids) > 0, f"identity held without {switch}"


def test_small_token_budget_and_prefix_cache_stay_lossless(engines, prompts):
    """Trees cut by a small max_num_batched_tokens (chunked prefill), with prefix caching reuse."""
    subset = prompts["humaneval"][:6]
    params = _params(len(subset), False)
    plain = _plain(engines, prompts, "humaneval", 6, False, 6)  # shared with test_jacobi
    llm = engines.get(
        "lookahead-tree-hier-small-budget",
        # Full trees (the forward-cost model off) so the token budget must cut some.
        lookahead={"draft_shape": "hier", "cost_free_tokens": 0, "source": "trie"},
        max_num_batched_tokens=32,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
    )
    from lookahead_lab.offline import find_proposers

    (proposer,) = find_proposers(llm)
    first = generate(llm, subset, params, 6)
    again = generate(llm, subset, params, 6)  # prompts now hit the prefix cache
    assert count_mismatches(plain.token_ids, first.token_ids) == 0
    assert count_mismatches(plain.token_ids, again.token_ids) == 0
    engines.release(llm)  # used here only
    assert proposer.stats.tree_truncated > 0, "the token budget never cut a tree"


def test_stop_strings_and_eos_inside_accepted_runs(engines, prompts):
    """Stop strings and EOS that fall inside an accepted tree path end the text exactly like plain."""
    subset = prompts["humaneval"][:8] + prompts["mtbench"][:4]
    params = _params(len(subset), True, stop=["\n\n", "return"])
    plain = generate(engines.get("plain"), subset, params, 12)
    ours = generate(_tree_engine(engines, "hier", cost_free_tokens=0), subset, params, 12)
    assert ours.texts == plain.texts
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert any(len(ids) < MAX_TOKENS for ids in plain.token_ids), "no request stopped early"
