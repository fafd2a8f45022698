"""Greedy identity on every class of the benchmark suite (test split), at batch 8 (and 1, slow).

One prompt per class (docqa's reach 2.6k tokens, so these engines allow
4096), 48 tokens each: lookahead's defaults must reproduce plain vLLM token
for token, and draft something on every class.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

# One prompt per class keeps every class held to plain; a second one per class
# doubled the time of the suite's slowest batch-8 case without a new class.
PER_CLASS = 1
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def suite_prompts(tokenizer) -> list[tuple[str, str]]:
    from lookahead_lab.datasets import DATASETS, load_split

    return [(name, text) for name in DATASETS for text in load_split(name, "test", tokenizer, PER_CLASS)]


# Batch 8 runs in the default suite; batch 1 takes several
# minutes on 2 cores and runs with -m slow.
@pytest.mark.parametrize("bs", [pytest.param(1, marks=pytest.mark.slow), 8])
def test_every_suite_class_greedy_identical_to_plain(engines, suite_prompts, bs):
    from vllm import SamplingParams

    from lookahead_lab.offline import count_mismatches, find_proposers, generate

    texts = [t for _, t in suite_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    plain = generate(engines.get("plain-4k", max_model_len=4096), texts, params, bs)
    llm = engines.get("lookahead-4k", max_model_len=4096)
    (proposer,) = find_proposers(llm)
    before = proposer.stats.counters()["draft_tokens"]
    ours = generate(llm, texts, params, bs)
    bad = [suite_prompts[i][0] for i, (a, b) in enumerate(zip(plain.token_ids, ours.token_ids)) if a != b]
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0, f"mismatched classes: {bad}"
    assert proposer.stats.counters()["draft_tokens"] > before
    assert ours.num_accepted > 0
