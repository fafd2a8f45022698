"""Per-request state through preemption and the drain (SmolLM2, CPU). Aborts
(clients that disconnect mid-stream) are in tests/serve/test_soak.py, which
asserts the server holds no request state once it drained.

A KV cache of a few blocks makes vLLM queue and preempt requests (counted:
the test fails if none was preempted). A request
sent with lookahead off must draft nothing throughout, every output must be
plain vLLM's, and once the engine drains the proposer holds no state.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MAX_TOKENS, count_preemptions, plain_run

pytestmark = pytest.mark.vllm

NUM = 8


def test_preemption_keeps_options_outputs_and_leaves_no_state(engines, prompts):
    from vllm import SamplingParams

    from lookahead_lab.offline import count_mismatches, find_proposers, generate

    texts = prompts["humaneval"][:NUM]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    # The first 8 HumanEval prompts at MAX_TOKENS, batch 8: plain's run is shared with other modules.
    plain = plain_run(engines, texts, greedy, NUM, ("humaneval[:8]", "greedy"))
    # 14 blocks of 32 tokens (one of them vLLM's null block) for 8 requests of 123-167 prompt
    # + 64 output tokens (6-8 blocks each): running requests outgrow their blocks mid-decode,
    # so vLLM preempts some (asserted below).
    llm = engines.get("lookahead-small-kv", num_gpu_blocks_override=14, block_size=32, max_model_len=256,
                      max_num_seqs=NUM)
    (proposer,) = find_proposers(llm)
    preemptions = count_preemptions(llm)
    off = {i for i in range(NUM) if i % 2}
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                             extra_args={"lookahead_enabled": False} if i in off else None) for i in range(NUM)]
    drafted = {"off": 0, "on": 0}
    original = proposer.propose

    def recording(sampled, num_tokens, token_ids, slot_mappings=None):
        drafts = original(sampled, num_tokens, token_ids, slot_mappings)
        for req_id, draft in zip(proposer._input_batch.req_ids, drafts):
            state = proposer.request_state(req_id)
            drafted["off" if state is not None and state.cap == 0 else "on"] += len(draft)
        return drafts

    proposer.propose = recording
    try:
        ours = generate(llm, texts, params, NUM)
    finally:
        del proposer.propose
    assert preemptions[0] > 0, "the small KV cache never forced a preemption"
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    # vLLM V1 re-admits a preempted request with all its tokens, so a rewind
    # is rare here; the rewind path itself is unit-tested in
    # tests/vllm/test_proposer.py (test_rewind_keeps_the_requests_options).
    assert drafted["off"] == 0 and drafted["on"] > 0, drafted
    generate(llm, texts[:1], SamplingParams(temperature=0.0, max_tokens=2), 1)  # reports the finished ids
    assert proposer.num_request_states() <= 1 and proposer.drafter.num_requests() <= 1
