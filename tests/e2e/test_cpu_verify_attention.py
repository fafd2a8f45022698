"""Steps with drafts run attention with the native CPU verification kernel (patch
``cpu_verify_attention``), and greedy output stays plain vLLM's.

On SmolLM2 (fp32) at batch 8 on HumanEval: the kernel runs on every attention layer of the steps
that carry drafts where the machine has AVX-512 (elsewhere never: vLLM's kernel verifies), and the
outputs equal plain's token for token; with the profile's ``cpu_verify_attention`` off it never runs.
"""

from __future__ import annotations

import pytest

from lookahead_lab.offline import count_mismatches, generate
from lookahead_vllm import _cpu_attention
from lookahead_vllm.ops import cpu_attention

from .conftest import MAX_TOKENS, PINNED_PRICES, plain_run

pytestmark = pytest.mark.vllm

STOCK = {**PINNED_PRICES, "_profile": {"cpu_verify_attention": False}}  # as "lookahead", the kernel off


@pytest.fixture
def kernel_calls(monkeypatch):
    """Each native call: the query tokens of its rows, and the longest row's."""
    calls = []
    attend = cpu_attention.StepRows.attend

    def counted(self, query, *args, **kwargs):
        lengths = (self.qsl[1:] - self.qsl[:-1]).tolist()
        calls.append((sum(lengths), max(lengths)))
        return attend(self, query, *args, **kwargs)

    monkeypatch.setattr(cpu_attention.StepRows, "attend", counted)
    return calls


@pytest.mark.parametrize("name,lookahead", [("lookahead", None), ("lookahead-stock-attention", STOCK)])
def test_drafted_steps_use_the_kernel_and_stay_lossless(engines, prompts, kernel_calls, name, lookahead):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ps = prompts["humaneval"][:8]
    plain = plain_run(engines, ps, params, 8, ("humaneval[:8]", "greedy"))  # shared with other modules
    llm = engines.get(name, **({"lookahead": lookahead} if lookahead else {}))
    ours = generate(llm, ps, params, 8)
    assert count_mismatches(plain.token_ids, ours.token_ids) == 0
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    if lookahead is None and _cpu_attention.isa() == "avx512":
        assert ours.num_drafts > 0 and kernel_calls and len(kernel_calls) % layers == 0
        assert all(1 < longest <= 64 for _, longest in kernel_calls)  # never a draftless step or a long prefill
    else:
        assert kernel_calls == []
