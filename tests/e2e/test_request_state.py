"""Per-request state through preemption, aborts and the drain (SmolLM2, CPU).

A KV cache of a few blocks forces vLLM to preempt running requests and
recompute them: the runner then rewinds their tokens. A request sent with
lookahead off must draft nothing before and after that, every output must be
plain vLLM's, and once the engine drains the proposer holds no state.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import plain_run

pytestmark = pytest.mark.vllm

NUM = 8
MAX_TOKENS = 96


def test_preemption_keeps_options_outputs_and_leaves_no_state(engines, prompts):
    from vllm import SamplingParams

    from lookahead_vllm.vllm.offline import count_mismatches, generate
    from lookahead_vllm.vllm.proposer import find_proposers

    texts = prompts["humaneval"][:NUM]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    plain = plain_run(engines, texts, greedy, NUM, ("request-state", MAX_TOKENS))
    # 4 blocks of 128 tokens for 8 requests of ~150 prompt + 96 output tokens: preemption.
    llm = engines.get("lookahead-small-kv", num_gpu_blocks_override=4, max_num_seqs=NUM)
    (proposer,) = find_proposers(llm)
    off = {i for i in range(NUM) if i % 2}
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                             extra_args={"lookahead_enabled": False} if i in off else None) for i in range(NUM)]
    drafted: dict[str, int] = {}
    original = proposer.propose

    def recording(sampled, num_tokens, token_ids, slot_mappings=None):
        drafts = original(sampled, num_tokens, token_ids, slot_mappings)
        for req_id, draft in zip(proposer._input_batch.req_ids, drafts):
            drafted[req_id] = drafted.get(req_id, 0) + len(draft)
        return drafts

    proposer.propose = recording
    try:
        ours = generate(llm, texts, params, NUM)
    finally:
        del proposer.propose
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert proposer.stats.rewinds > 0, "no request was preempted: the KV cache is too large for this test"
    # vLLM's request ids carry the prompt index first ("3-...").
    by_prompt = {int(r.split("-")[0]): n for r, n in drafted.items()}
    assert all(by_prompt.get(i, 0) == 0 for i in off), by_prompt
    assert sum(by_prompt.get(i, 0) for i in range(NUM) if i not in off) > 0
    generate(llm, texts[:1], SamplingParams(temperature=0.0, max_tokens=2), 1)  # reports the finished ids
    assert proposer.num_request_states() <= 1 and proposer.drafter.num_requests() <= 1
