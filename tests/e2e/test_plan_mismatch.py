"""A tree plan that does not match the drafts vLLM scheduled is verified as a chain, counted, and stays lossless.

SmolLM2-135M-Instruct (fp32). The proposer's drafts are altered after it kept
its plans (the last token of every other step's drafts flipped), so
``TreeVerifier.begin_step`` sees scheduled drafts that differ from the plan:
those request-steps must fall back to vLLM's chain verification (before the
fallback this raised and killed the engine) while the untouched steps still
verify trees.
"""

from __future__ import annotations

import pytest

from lookahead_lab.offline import count_mismatches, generate

from .conftest import MAX_TOKENS

pytestmark = pytest.mark.vllm


def _flip_last_tokens(proposer):
    """Wrap ``proposer.propose``: every other call, flip the last token of each draft of 2+ tokens."""
    original = proposer.propose
    calls = [0]

    def propose(*args, **kwargs):
        drafts = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] % 2:
            return drafts
        return [d[:-1] + [d[-1] ^ 1] if len(d) >= 2 else d for d in drafts]

    proposer.propose = propose
    return lambda: setattr(proposer, "propose", original)


def test_plan_mismatch_falls_back_to_chain_losslessly(engines, prompts):
    from vllm import SamplingParams

    from lookahead_lab.offline import find_proposers

    subset = prompts["humaneval"][:4]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    plain = generate(engines.get("plain"), subset, params, 4)
    # Full trees (the forward-cost model off), so most drafts are trees. The
    # engine is shared with test_sampling (conftest.SHARED_ENGINES).
    llm = engines.get("lookahead-hier-cost0", lookahead={"draft_shape": "hier", "cost_free_tokens": 0})
    (proposer,) = find_proposers(llm)
    mismatches = proposer.verifier.plan_mismatches
    trees = proposer.stats.tree_request_steps
    restore = _flip_last_tokens(proposer)
    try:
        ours = generate(llm, subset, params, 4)
    finally:
        restore()
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert proposer.verifier.plan_mismatches > mismatches, "no scheduled draft differed from its plan"
    assert proposer.stats.tree_request_steps > trees, "the unaltered steps verified no tree"
    assert ours.num_accepted > 0
