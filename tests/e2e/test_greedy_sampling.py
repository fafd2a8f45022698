"""On a real engine's steps, greedy verification from one argmax gives what vLLM's samplers give.

Lookahead's ``runner_sampling`` patch verifies a greedy batch's drafts from one argmax over its
logits (``patches.greedy_sample``). Here every step with drafts of the shared lookahead engine
on MT-Bench at batch 8 is sampled both ways, from the same logits: the tokens are the same at
every step, and the output equals plain vLLM's; the steps without drafts (there are some) run
vLLM's plain sampler and never reach the argmax path. A batch holding one request that asks
for logprobs is left to vLLM's samplers, so is one under its ``min_tokens`` until it has them,
and so is every step with the profile's `argmax_sampling` off. In tree mode a greedy step takes
one argmax: tree verification reads the tree rows' targets from the one ``greedy_sample`` took.
"""

from __future__ import annotations

import pytest

from lookahead_lab.offline import count_mismatches, find_proposers, generate

from .conftest import MAX_TOKENS, PINNED_PRICES, plain_run

pytestmark = pytest.mark.vllm


@pytest.fixture
def both_ways(monkeypatch):
    """Each step's argmax sample beside vLLM's own sample of the same logits."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lookahead_vllm.vllm import patches

    assert patches.apply("runner_sampling")
    stock = GPUModelRunner._sample.__lookahead_original__  # vLLM's _sample, under the patch
    fast = patches.greedy_sample
    log = {"drafted": 0, "draftless": 0, "stock_only": 0, "differ": []}

    def compared(runner, logits, spec_metadata):
        ours = fast(runner, logits, spec_metadata)
        theirs = stock(runner, logits.clone(), spec_metadata)
        if ours is None:
            log["stock_only"] += 1
            return None
        log["drafted" if spec_metadata is not None else "draftless"] += 1
        if ours.sampled_token_ids.tolist() != theirs.sampled_token_ids.tolist():
            log["differ"].append((ours.sampled_token_ids.tolist(), theirs.sampled_token_ids.tolist()))
        return ours

    monkeypatch.setattr(patches, "greedy_sample", compared)
    return log


def test_every_step_samples_what_vllms_samplers_sample(engines, prompts, both_ways):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    ps = prompts["mtbench"]
    plain = plain_run(engines, ps, params, 8, ("mtbench", "greedy"))
    llm = engines.get("lookahead")
    (proposer,) = find_proposers(llm)
    draftless = proposer.metrics.draftless_steps
    ours = generate(llm, ps, params, 8)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert both_ways["differ"] == []
    assert both_ways["drafted"] > 0 and both_ways["stock_only"] == 0
    assert both_ways["draftless"] == 0 and proposer.metrics.draftless_steps > draftless


def test_a_batch_with_logprobs_keeps_vllms_samplers(engines, prompts, both_ways):
    from vllm import SamplingParams

    ps = prompts["humaneval"][:4]
    params = [SamplingParams(temperature=0.0, max_tokens=16, logprobs=2 if i == 1 else None) for i in range(4)]
    plain = plain_run(engines, ps, params, 4, ("humaneval[:4]", "greedy, one with logprobs"))
    ours = generate(engines.get("lookahead"), ps, params, 4)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert both_ways["stock_only"] > 0 and both_ways["differ"] == []


def test_min_tokens_keeps_vllms_samplers_only_until_it_is_reached(engines, prompts, both_ways):
    """A request under its ``min_tokens`` sends its batch's steps to vLLM's samplers (its stop
    tokens are masked); once it has its minimum, vLLM's processor lets it go and the steps take
    the argmax again. The output is plain vLLM's for the same params."""
    from vllm import SamplingParams

    ps = prompts["humaneval"][:4]
    # The others finish first: every step with drafts holds the min_tokens request, so the argmax
    # steps are ones after it reached its minimum.
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS if i == 1 else 8, min_tokens=24 if i == 1 else 0)
              for i in range(4)]
    plain = plain_run(engines, ps, params, 4, ("humaneval[:4]", "greedy, one with min_tokens 24, 3 of 8 tokens"))
    ours = generate(engines.get("lookahead"), ps, params, 4)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert both_ways["stock_only"] > 0 and both_ways["drafted"] > 0 and both_ways["differ"] == []


def test_argmax_sampling_off_keeps_vllms_samplers(engines, prompts, both_ways):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ps = prompts["humaneval"][:8]
    plain = plain_run(engines, ps, params, 8, ("humaneval[:8]", "greedy"))
    llm = engines.get("lookahead-stock-sampling", lookahead={"_profile": {"argmax_sampling": False}})
    ours = generate(llm, ps, params, 8)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0 and ours.num_drafts > 0
    assert both_ways == {"drafted": 0, "draftless": 0, "stock_only": 0, "differ": []}


def test_tree_steps_read_the_argmax_greedy_sample_took(engines, prompts, both_ways, monkeypatch):
    """In tree mode a greedy step with drafts takes one argmax: tree verification reads its tree
    rows' targets from the one ``greedy_sample`` took (which the output carries), and the output
    stays plain vLLM's."""
    from vllm import SamplingParams

    from lookahead_vllm.ops.sampling import row_argmax
    from lookahead_vllm.vllm import tree_verify

    log = {"tree_steps": 0, "handed": 0, "taken": 0}
    finish_step = tree_verify.TreeVerifier.finish_step

    def counted(self, runner, logits, spec_metadata, sampler_output):
        if self.current is not None and spec_metadata is not None:
            log["tree_steps"] += 1
            log["handed"] += getattr(sampler_output, "logits_argmax", None) is not None
        return finish_step(self, runner, logits, spec_metadata, sampler_output)

    def taken(rows, *args):
        log["taken"] += 1
        return row_argmax(rows, *args)

    monkeypatch.setattr(tree_verify.TreeVerifier, "finish_step", counted)
    monkeypatch.setattr(tree_verify, "row_argmax", taken)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ps = prompts["humaneval"][:8]
    plain = plain_run(engines, ps, params, 8, ("humaneval[:8]", "greedy"))
    # The engine test_tree_verify's index trees use (conftest.SHARED_ENGINES).
    llm = engines.get("lookahead-hier-cost0", lookahead={"draft_shape": "hier", "cost_free_tokens": 0})
    assert find_proposers(llm)[0].tree_mode
    ours = generate(llm, ps, params, 8)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert both_ways["differ"] == [] and both_ways["stock_only"] == 0
    assert log["tree_steps"] > 0 and log["handed"] == log["tree_steps"] and log["taken"] == 0, log


@pytest.mark.parametrize("lookahead", [dict(PINNED_PRICES), {"draft_shape": "hier", "cost_free_tokens": 0}],
                         ids=["chain", "hier"])
def test_logprob_token_ids_answered_as_plain(engines, prompts, monkeypatch, lookahead):
    """vLLM's rejection sampler answers a drafted step without ``logprob_token_ids``' logprobs (for every row), so no
    request drafts while one runs, and the step that admits one beside rows drafted the step before is sampled as
    plain decoding (``patches.sample_undrafted``): every token and logprob is plain's. Two sequences at a time: the
    third request joins when the second ends, while the first still drafts."""
    from vllm import SamplingParams

    from lookahead_vllm.vllm import patches

    undrafted = []
    sample = patches.sample_undrafted
    monkeypatch.setattr(patches, "sample_undrafted", lambda *a: undrafted.append(1) or sample(*a))
    ps = prompts["humaneval"][:3]
    params = [SamplingParams(temperature=0.0, max_tokens=32), SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(temperature=0.0, max_tokens=12, logprob_token_ids=[28, 1003, 18526])]
    plain = engines.get("plain-2seqs", max_num_seqs=2).generate(ps, params, use_tqdm=False)
    llm = engines.get(f"lookahead-2seqs-{lookahead.get('draft_shape', 'one')}", max_num_seqs=2, lookahead=lookahead)
    (proposer,) = find_proposers(llm)
    ours = llm.generate(ps, params, use_tqdm=False)
    for p, o in zip(plain, ours):
        assert o.outputs[0].token_ids == p.outputs[0].token_ids
    expected, got = plain[2].outputs[0].logprobs, ours[2].outputs[0].logprobs
    assert len(got) == len(expected) == 12  # before the fix: the first token's only
    for e, g in zip(expected, got):
        assert sorted(g) == sorted(e) and all(abs(g[t].logprob - e[t].logprob) < 1e-4 for t in e)
    assert len(undrafted) == 1 and proposer.stats.counters()["draft_tokens"] > 0  # the admission step; drafts
