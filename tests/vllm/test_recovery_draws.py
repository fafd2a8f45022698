"""Speculative sampling's recovered tokens in a lookahead engine (patch recovery_draws).

When a sampled draft token is rejected, vLLM emits a token drawn from the target distribution less the draft
(``argmax(p / q)`` over Exp(1) noise ``q``). A lookahead step draws that noise with
``sampling.recovery_exponentials``: only for the requests that can use it, from faster draws. Held here to:

* the distribution: recovered tokens are drawn from ``p`` without the draft token, in proportion;
* seeded requests: their noise, and so their recovered tokens, are vLLM's own for the same generator;
* the noise's rows: Exp(1) where a sampled request drafted, 1 elsewhere (greedy, undrafted);
* other engines: outside a lookahead step vLLM's function runs as it is.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from lookahead_vllm.ops.sampling import recovery_exponentials  # noqa: E402
from lookahead_vllm.vllm import patches  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def rejection_sampler():
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs

    from lookahead_vllm.vllm.plugin import register

    register()
    if not current_platform.is_cpu():
        pytest.skip("the rejection sampler's kernels run here through vLLM's CPU overrides")
    current_platform.register_triton_kernel_overrides()  # as an engine does at start (once a process)
    assert patches.apply("recovery_draws")
    return rs


def _metadata(temperature, generators=None):
    t = torch.tensor(temperature, dtype=torch.float32)
    return SimpleNamespace(all_random=bool((t > 0).all()), temperature=t, generators=generators or {})


def _recover(rs, probs, drafts, num_draft_tokens, metadata, lookahead=True, monkeypatch=None):
    """Recovered tokens for rows of ``probs`` (one per draft token, request after request)."""
    cu = torch.tensor(num_draft_tokens, dtype=torch.int32).cumsum(0).to(torch.int32)
    monkeypatch.setattr(patches, "_lookahead_sampling", lookahead)
    return rs.sample_recovered_tokens(max(num_draft_tokens), num_draft_tokens, cu,
                                      torch.tensor(drafts, dtype=torch.int32), None, probs, metadata, "cpu")


def test_recovered_tokens_follow_the_target_less_the_draft(rejection_sampler, monkeypatch):
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    n = 4000  # requests of one draft token each (draft: token 1), one batch
    tokens = _recover(rejection_sampler, p.repeat(n, 1).contiguous(), [1] * n, [1] * n, _metadata([0.8] * n),
                      monkeypatch=monkeypatch)
    counts = torch.bincount(tokens.long(), minlength=5).double()
    expected = torch.tensor([0.05, 0.0, 0.25, 0.2, 0.1]) / 0.6 * n
    assert counts[1] == 0
    # Within 5 standard deviations of a multinomial count in every token.
    sd = (expected * (1 - expected / n)).sqrt()
    assert ((counts - expected).abs() <= 5 * sd + 1e-9).all(), (counts, expected)


def test_seeded_requests_draw_what_vllm_draws(rejection_sampler, monkeypatch):
    probs = torch.softmax(torch.randn(5, 64), -1)
    drafts, num = [3, 7, 1, 9, 4], [2, 0, 3]  # request 1 drafted nothing
    outs = []
    for lookahead in (True, False):
        generators = {0: torch.Generator().manual_seed(5), 2: torch.Generator().manual_seed(6)}
        outs.append(_recover(rejection_sampler, probs, drafts, num, _metadata([0.7, 0.7, 0.9], generators),
                             lookahead, monkeypatch))
    assert torch.equal(outs[0], outs[1])  # every drafting request seeded: the same draws as vLLM's


def test_noise_only_where_a_sampled_request_drafted():
    greedy = torch.tensor([True, False, True, True])  # draws: request 1 is greedy
    generator = torch.Generator().manual_seed(3)
    q = recovery_exponentials([2, 3, 0, 1], greedy, {3: generator}, 50000, torch.float32, "cpu")
    assert torch.equal(q[1], torch.ones(50000)) and torch.equal(q[2], torch.ones(50000))
    assert torch.equal(q[3], torch.empty(50000).exponential_(generator=torch.Generator().manual_seed(3)))
    assert 0.98 < float(q[0].mean()) < 1.02 and 0.97 < float(q[0].var()) < 1.03  # Exp(1): mean 1, variance 1
    assert float((q[0] > 3).double().mean()) == pytest.approx(float(torch.exp(torch.tensor(-3.0))), abs=0.005)


def test_outside_a_lookahead_step_vllm_draws(rejection_sampler, monkeypatch):
    probs = torch.softmax(torch.randn(3, 64), -1)
    ours = []
    for wrapped in (True, False):
        torch.manual_seed(11)
        if wrapped:
            ours.append(_recover(rejection_sampler, probs, [1, 2, 3], [3], _metadata([0.8]), False, monkeypatch))
        else:
            original = rejection_sampler.sample_recovered_tokens.__lookahead_original__
            cu = torch.tensor([3], dtype=torch.int32)
            ours.append(original(3, [3], cu, torch.tensor([1, 2, 3], dtype=torch.int32), None, probs,
                                 _metadata([0.8]), "cpu"))
    assert torch.equal(ours[0], ours[1])
