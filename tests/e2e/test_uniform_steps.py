"""Uniform steps: every row's chain filled to exactly k draft tokens, output unchanged.

On a GPU vLLM replays a full CUDA graph only for a step whose every request
scores 1 + k tokens, and runs any other step piecewise: a SmolLM2 step on an
H200 took 9-20 ms piecewise and 2.7 ms as a full graph. Where the engine
captured full graphs the proposer fills every row's chain to k (profile
``uniform_steps``). This CPU engine captures none, so the test sets the graph
size the proposer would have read (``_uniform_tokens``) by hand and holds the
filled steps to plain vLLM's greedy output.
"""

from __future__ import annotations

import pytest

from lookahead_lab.offline import count_mismatches, find_proposers, generate

from .conftest import MAX_TOKENS, plain_run

pytestmark = pytest.mark.vllm


def test_filled_steps_carry_k_tokens_a_row_and_keep_the_output(engines, prompts, monkeypatch):
    from vllm import SamplingParams

    from lookahead_vllm.vllm.proposer import LookaheadProposer

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ps = prompts["humaneval"][:8]
    plain = plain_run(engines, ps, params, 8, ("humaneval[:8]", "greedy"))
    # The shared engine (its configuration: the defaults, PINNED_PRICES), started cold as a fresh
    # one would: its drafter, calibration and prefix cache emptied; the fill is undone below.
    llm = engines.get("lookahead")
    (proposer,) = find_proposers(llm)
    assert proposer._uniform_tokens == 0  # no CUDA graphs on the CPU: nothing filled unless set
    proposer.reset()
    assert llm.reset_prefix_cache()
    proposer._uniform_tokens = 512
    k = proposer.k
    steps = []
    on_step = LookaheadProposer.on_step

    def logged(self, input_batch, finished, scheduled=None, shape=None):
        if shape is not None and shape.pure_decode:
            steps.append(sorted(map(len, (scheduled or {}).values())))
        return on_step(self, input_batch, finished, scheduled, shape)

    monkeypatch.setattr(LookaheadProposer, "on_step", logged)
    before = proposer.stats.counters()
    try:
        ours = generate(llm, ps, params, 8)
    finally:
        proposer._uniform_tokens = 0
    after = proposer.stats.counters()
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    filled = after["uniform_steps"] - before["uniform_steps"]
    assert filled > 0 and after["fill_tokens"] > before["fill_tokens"]
    # A filled step's drafts reach the scheduler whole: every row k tokens (the last filled
    # step's drafts may never be scheduled: its requests can finish on that step).
    uniform = [s for s in steps if s and s[0] == k]
    assert len(uniform) >= filled - 1 and all(set(s) == {k} for s in uniform)
    # Booking reads only the planned part: acceptance stays that of real drafts.
    assert ours.mean_acceptance_length > 1.2
