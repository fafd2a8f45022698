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
