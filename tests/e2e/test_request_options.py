"""Per-request lookahead control offline: ``SamplingParams(extra_args=...)``."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

N = 6


def _params(max_tokens: int = 48, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra or None)


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].spec_decode_metrics for o in outs]


def test_off_and_capped_requests_identical_and_drafts_limited(engines, prompts):
    batch = prompts["humaneval"][:N]
    llm = engines.get("lookahead")
    ref, _ = _run(engines.get("plain"), batch, _params())
    # One batch mixing three kinds of request: default, off, capped at 1 draft token per step.
    params = [_params(), _params(lookahead_enabled=False), _params(lookahead_max_draft_tokens=1)] * (N // 3)
    ids, metrics = _run(llm, batch, params)
    assert ids == ref
    for i, m in enumerate(metrics):
        kind = i % 3
        if kind == 0:
            assert m.num_draft_tokens > 0
        elif kind == 1:
            assert m.num_draft_tokens == 0 and sum(m.histogram) == 0
        else:
            assert 0 < m.num_draft_tokens <= sum(m.histogram)  # <= 1 draft token per verify step


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"lookahead_enabled": "nope"}, r"lookahead_enabled='nope': must be true or false"),
        ({"lookahead_max_draft_tokens": 300}, r"lookahead_max_draft_tokens=300: must be an integer in \[0, 256\]"),
        ({"lookahead_budget": 3}, r"unknown per-request lookahead key\(s\) \['lookahead_budget'\]"),
    ],
)
def test_bad_extra_args_rejected_at_construction(engines, extra, message):
    engines.get("lookahead")  # the plugin is loaded with the engine
    with pytest.raises(ValueError, match=message):
        _params(**extra)


def test_min_p_and_logit_bias_served_as_plain(engines, prompts):
    """vLLM refuses ``min_p`` and ``logit_bias`` with any speculative method; a lookahead engine serves them
    (patches plain_sampling_params, runner_logits_processors): those requests draft nothing, not even when they
    enable lookahead, and get plain vLLM's tokens, while the other requests of the same batch draft."""
    from vllm import SamplingParams

    batch = prompts["humaneval"][:N]
    plain, llm = engines.get("plain"), engines.get("lookahead")
    unbiased, _ = _run(plain, batch, _params())
    # A bias that moves greedy decoding: the first token of each unbiased answer banned.
    biased = [SamplingParams(temperature=0.0, max_tokens=48, logit_bias={ids[0]: -100.0}) for ids in unbiased]
    biased[3] = SamplingParams(temperature=0.0, max_tokens=48, logit_bias={unbiased[3][0]: -100.0},
                               extra_args={"lookahead_enabled": True})
    min_p = [SamplingParams(temperature=1.5, max_tokens=48, min_p=0.2, seed=i) for i in range(N)]
    no_min_p = [SamplingParams(temperature=1.5, max_tokens=48, seed=i) for i in range(N)]
    params = [[_params(), biased[i], min_p[i]][i % 3] for i in range(N)]
    ref, _ = _run(plain, batch, params)
    ids, metrics = _run(llm, batch, params)
    assert ids == ref
    for i, m in enumerate(metrics):
        if i % 3 == 0:
            assert m.num_draft_tokens > 0
        else:
            assert m.num_draft_tokens == 0 and sum(m.histogram) == 0
    # The parameters moved the tokens (so the engine applied them): bias against none, min_p against none.
    assert all(ref[i] != unbiased[i] for i in range(1, N, 3))
    free, _ = _run(plain, batch, [params[i] if i % 3 != 2 else no_min_p[i] for i in range(N)])
    assert any(ref[i] != free[i] for i in range(2, N, 3))
