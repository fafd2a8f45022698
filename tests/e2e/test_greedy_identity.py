"""Greedy lossless: lookahead's token ids equal plain vLLM's, on a real trained model.

SmolLM2-135M-Instruct (fp32): HumanEval at batch 1 (the first NUM_BS1 = 5 prompts) and batch 8 (prompts 8-15),
10 MT-Bench prompts at batch 8, plus a floor on mean acceptance length so the drafts are really used.
"""

from __future__ import annotations


import pytest

from lookahead_lab.offline import count_mismatches, find_proposers, generate

from .conftest import MAX_TOKENS, NUM_BS1, plain_run

pytestmark = pytest.mark.vllm

# Floors on vLLM's mean acceptance length (1 + accepted / drafts) at
# MAX_TOKENS=64; measured values are recorded in the issue notes.
# vLLM's mean acceptance length (1 + accepted / steps that carried a draft).
# The draft index drafts on more steps than the trie did (its 1-token back-off
# finds a match almost always), so per drafted step MT-Bench sits at ~1.49
# (measured at k=16) where the trie's k=8 drafts gave >= 1.5.
MAL_FLOOR = {"humaneval": 2.0, "mtbench": 1.4}
# Batch 1 runs the first NUM_BS1 = 5 HumanEval prompts only: with the pinned
# prices their mean acceptance length is 1.96 (measured; the first 10 give
# >= 2.0). Without drafts it would be 1.
MAL_FLOOR_BS1 = {"humaneval": 1.9, "mtbench": 1.4}
# Batch 8 runs one batch of HumanEval prompts 8-15: text the engine has not seen (the batch-1
# run wrote prompts 0-4's outputs, which it would draft whole), mean acceptance length 2.58
# measured (all 20 prompts, three batches, took 2.5 times as long). MT-Bench runs all 10 (two batches).
HUMANEVAL_BS8 = slice(8, 16)


def _greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _plain(engines, prompts, dataset, bs):
    return plain_run(engines, prompts[dataset], _greedy(), bs, (dataset, "greedy"))


# Batch 1 runs the first NUM_BS1 prompts only (a batch-1 step per token is the
# slow part of the default suite; their plain run is shared with test_jacobi
# and test_tree_verify); batch 8 runs them all.

# MT-Bench at batch 1 (~50 s) runs with -m slow; the default suite keeps it at
# batch 8, HumanEval at both, and test_suite_identity every class at batch 8.
@pytest.mark.parametrize("dataset,bs", [
    ("humaneval", 1), ("humaneval", 8), pytest.param("mtbench", 1, marks=pytest.mark.slow), ("mtbench", 8)])
def test_lookahead_greedy_identical_to_plain(engines, prompts, dataset, bs):
    if bs == 1:
        ps = prompts[dataset][:NUM_BS1]
        plain = plain_run(engines, ps, _greedy(), bs, (f"{dataset}[:{NUM_BS1}]", "greedy"))
    elif dataset == "humaneval":
        ps = prompts[dataset][HUMANEVAL_BS8]
        plain = plain_run(engines, ps, _greedy(), bs, ("humaneval[8:16]", "greedy"))
    else:
        ps = prompts[dataset]
        plain = _plain(engines, prompts, dataset, bs)
    ours = generate(engines.get("lookahead"), ps, _greedy(), bs)
    assert len(ours.token_ids) == len(ps)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    assert ours.num_drafts > 0
    floor = (MAL_FLOOR_BS1 if bs == 1 else MAL_FLOOR)[dataset]
    assert ours.mean_acceptance_length >= floor, ours.mean_acceptance_length


def test_step_draft_budget_honoured_and_lossless(engines, prompts):
    # One batch of 8 (its plain run shared with other modules).
    ps = prompts["humaneval"][:8]
    plain = plain_run(engines, ps, _greedy(), 8, ("humaneval[:8]", "greedy"))
    llm = engines.get("lookahead-budget", lookahead={"_profile": {"step_draft_budget": 4}})
    ours = generate(llm, ps, _greedy(), 8)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    (proposer,) = find_proposers(llm)
    assert proposer.stats.max_step_draft_tokens <= 4
    assert ours.num_drafts > 0


def test_proposer_state_released_after_requests_finish(engines, prompts):
    llm = engines.get("lookahead")
    generate(llm, prompts["mtbench"][:3], _greedy(8), 3)
    generate(llm, prompts["mtbench"][:1], _greedy(4), 1)  # a step that reports the finished ids
    (proposer,) = find_proposers(llm)
    assert proposer.num_request_states() <= 1 and proposer.drafter.num_requests() <= 1
    stats = proposer.stats.counters()
    assert stats["draft_tokens"] > 0 and stats["propose_ns"] > 0


def test_aborted_request_state_released(engines, prompts):
    """An aborted request's drafting state goes (finished ones are covered above)."""
    from vllm import SamplingParams

    llm = engines.get("lookahead-abort")
    engine = llm.llm_engine
    (proposer,) = find_proposers(llm)
    engine.add_request("abort-me", prompts["mtbench"][0], SamplingParams(temperature=0.0, max_tokens=200))
    for _ in range(4):
        engine.step()
    (live,) = proposer.request_ids()
    assert live.startswith("abort-me") and proposer.drafter.num_requests() == 1
    engine.abort_request(["abort-me"])
    engine.add_request("next", prompts["mtbench"][1], SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(r.startswith("abort-me") for r in proposer.request_ids())
    assert proposer.drafter.num_requests() <= 1


@pytest.mark.parametrize("bs", [pytest.param(1, marks=pytest.mark.slow), 8])  # each alone: 40 s, so -m slow
def test_request_options_vllm_applies_keep_plain_output(engines, prompts, tokenizer, bs):
    """Options vLLM applies at every position, drafted ones included (stops, penalties, token limits, logprobs):
    each request's tokens, text, finish reason and logprob ids are plain vLLM's, with the options mixed in one
    batch or alone."""
    from vllm import SamplingParams

    newline = tokenizer.encode("\n")[-1]
    options = [{"stop_token_ids": [newline]}, {"stop": ["return", "\n\n"], "include_stop_str_in_output": True},
               {"ignore_eos": True}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.8},
               {"bad_words": ["return", " the"]}, {"allowed_token_ids": list(range(4000))},
               {"prompt_logprobs": 2, "logprobs": 3}]
    params = [SamplingParams(temperature=0.0, max_tokens=40, **kw) for kw in options]
    ps = prompts["humaneval"][16:20] + prompts["mtbench"][6:10]

    def run(llm):
        got = []
        for lo in range(0, len(ps), bs):
            for out in llm.generate(ps[lo:lo + bs], params[lo:lo + bs], use_tqdm=False):
                c = out.outputs[0]
                prompt_lps = [sorted(d or ()) for d in out.prompt_logprobs or ()]
                got.append((list(c.token_ids), c.text, c.finish_reason, [sorted(d) for d in c.logprobs or ()],
                            prompt_lps))
        return got

    plain = run(engines.get("plain"))
    llm = engines.get("lookahead")
    (proposer,) = find_proposers(llm)
    drafted = proposer.stats.counters()["draft_tokens"]
    ours = run(llm)
    assert [o[2] for o in plain].count("stop") >= 2 and plain[-1][3] and plain[-1][4]  # stops end some early
    assert [i for i, (a, b) in enumerate(zip(plain, ours)) if a != b] == []
    assert proposer.stats.counters()["draft_tokens"] > drafted
