"""Steps without drafts cost what plain vLLM's cost: no speculative metadata, no rejection sampling.

vLLM 0.32 runs every step of a speculative engine through the rejection
sampler, drafts or none; lookahead's ``draftless_steps`` patch runs a step in
which no request carries a draft token as plain decoding. On SmolLM2 (fp32):

* a load that stops drafting altogether (``load_stop_at=1``): no step drafts,
  none is sampled with speculative metadata, every one is counted draftless, and the
  greedy output equals plain vLLM's;
* the default configuration on MT-Bench at batch 8 (drafts on some steps, not
  on others): exactly the steps whose batch carries a draft token are
  sampled with speculative metadata, the rest run draftless, and the output equals plain's;
* a request decoding up to ``max_model_len``: within k tokens of it vLLM would
  schedule k zero tokens a row (``drafter_near_max_len`` keeps the proposer in
  charge), so with drafting stopped no step carries a draft there either.
"""

from __future__ import annotations

import pytest

from lookahead_lab.offline import count_mismatches, generate

from .conftest import MAX_TOKENS, plain_run

pytestmark = pytest.mark.vllm

NO_DRAFTS = {"_profile": {"load_shrink_above": 0, "load_stop_at": 1}}  # a load that stops drafting


def _greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture
def step_log(monkeypatch):
    """Per engine step: whether its batch carried draft tokens; and the steps sampled with
    speculative metadata (vLLM's rejection sampler, or ``greedy_verify`` in its place)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lookahead_vllm.vllm import patches
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    assert patches.apply("runner_sampling")  # before the wrap below, which teardown undoes
    log = {"drafted": [], "verify_calls": 0}
    on_step, sample = LookaheadProposer.on_step, GPUModelRunner._sample

    def logged_on_step(self, input_batch, finished, scheduled=None, shape=None):
        log["drafted"].append(any((scheduled or {}).values()))
        return on_step(self, input_batch, finished, scheduled, shape)

    def counted_sample(self, logits, spec_decode_metadata):
        log["verify_calls"] += spec_decode_metadata is not None
        return sample(self, logits, spec_decode_metadata)

    monkeypatch.setattr(LookaheadProposer, "on_step", logged_on_step)
    monkeypatch.setattr(GPUModelRunner, "_sample", counted_sample)
    return log


def _proposer(llm):
    from lookahead_lab.offline import find_proposers

    (proposer,) = find_proposers(llm)
    return proposer


def test_a_load_that_stops_drafting_runs_plain_steps(engines, prompts, step_log):
    # One batch of 8 is enough to see every step run draftless.
    ps = prompts["humaneval"][:8]
    plain = plain_run(engines, ps, _greedy(), 8, ("humaneval[:8]", "greedy"))  # shared with other modules
    llm = engines.get("lookahead-nodraft", lookahead=NO_DRAFTS)
    before = _proposer(llm).metrics.draftless_steps
    ours = generate(llm, ps, _greedy(), 8)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert ours.num_drafts == 0 and not any(step_log["drafted"])
    assert step_log["verify_calls"] == 0
    assert _proposer(llm).metrics.draftless_steps - before == len(step_log["drafted"]) > 0


def test_only_steps_with_drafts_are_verified(engines, prompts, step_log):
    ps = prompts["mtbench"]
    plain = plain_run(engines, ps, _greedy(), 8, ("mtbench", "greedy"))
    llm = engines.get("lookahead")
    before = _proposer(llm).metrics.draftless_steps
    ours = generate(llm, ps, _greedy(), 8)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    drafted = sum(step_log["drafted"])
    assert 0 < drafted < len(step_log["drafted"])  # both kinds of step happened
    assert step_log["verify_calls"] == drafted
    assert _proposer(llm).metrics.draftless_steps - before == len(step_log["drafted"]) - drafted


def test_a_request_reaching_max_model_len_gets_no_zero_drafts(engines, tokenizer, step_log):
    from vllm import SamplingParams

    llm = engines.get("lookahead-nodraft", lookahead=NO_DRAFTS)
    room = 24  # decoded up to max_model_len: the last 16 + 1 steps are within k of it
    limit = llm.llm_engine.model_config.max_model_len
    ids = tokenizer("def square(x):\n    return x * x\n\n" * 400, add_special_tokens=False)["input_ids"]
    prompt = {"prompt_token_ids": ids[:limit - room]}
    params = SamplingParams(temperature=0.0, max_tokens=room)
    plain = plain_run(engines, [prompt], params, 1, ("near max_model_len", "greedy"))
    ours = generate(llm, [prompt], params, 1)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0 and len(ours.token_ids[0]) == room
    assert len(step_log["drafted"]) >= room - 1 and not any(step_log["drafted"])
    assert step_log["verify_calls"] == 0
