"""Speculative sampling of drafts in a lookahead engine on the CPU (patch rejection_sampling).

vLLM's ``rejection_sample`` accepts a sampled draft token ``d`` with probability ``p(d)`` and replaces the first
rejected by ``argmax(p / q)`` over a vocabulary of Exp(1) noise ``q`` a request. A lookahead step runs
``sampling.sample_drafted`` instead: one uniform a draft token, one draw a rejected request (seeded requests: vLLM's
draws). Held here to:

* greedy requests: the tokens vLLM's function emits, whatever the batch holds (zero drafts, padded drafts);
* sampled requests: the speculative-sampling distribution (each emitted token follows its row's target
  distribution given the tokens before it);
* seeded requests: vLLM's draws, in vLLM's order, so vLLM's tokens;
* steps outside a lookahead engine: vLLM's own function.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from lookahead_vllm.ops.sampling import sample_drafted  # noqa: E402
from lookahead_vllm.vllm import patches  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def rs():
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from lookahead_vllm.vllm.plugin import register

    register()
    if not current_platform.is_cpu():
        pytest.skip("the rejection sampler's kernels run here through vLLM's CPU overrides")
    current_platform.register_triton_kernel_overrides()  # as an engine does at start (once a process)
    assert patches.apply("rejection_sampling")
    return rejection_sampler


def _metadata(temperature, generators=None):
    t = torch.tensor(temperature, dtype=torch.float32)
    return SimpleNamespace(all_random=bool((t > 0).all()), all_greedy=bool((t == 0).all()), temperature=t,
                           generators=generators or {})


def _sample(rs, logits, drafts, counts, bonus, metadata, lookahead=True, monkeypatch=None):
    """``rejection_sample`` through the patch, in (``lookahead``) or out of a lookahead step."""
    monkeypatch.setattr(patches, "_lookahead_sampling", lookahead)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return rs.rejection_sample(torch.tensor(drafts, dtype=torch.int32), counts, max(counts), cu, None, logits,
                               torch.tensor(bonus, dtype=torch.int64)[:, None], metadata)


def test_greedy_requests_emit_what_vllm_emits(rs, monkeypatch):
    torch.manual_seed(0)
    counts = [3, 0, 2, 4, 1]
    logits = torch.randn(sum(counts), 40)
    argmax = logits.argmax(-1).tolist()
    # Request 0 keeps its first two drafts, 2 all of them, 3 none, 4 a padded (-1) draft.
    drafts = [argmax[0], argmax[1], (argmax[2] + 1) % 40, argmax[3], argmax[4], (argmax[5] + 1) % 40, argmax[6],
              argmax[7], argmax[8], -1]
    bonus = [11, 12, 13, 14, 15]
    ours = _sample(rs, logits, drafts, counts, bonus, _metadata([0.0] * 5), True, monkeypatch)
    vllm = _sample(rs, logits, drafts, counts, bonus, _metadata([0.0] * 5), False, monkeypatch)
    assert torch.equal(ours, vllm)
    assert ours.tolist()[:3] == [[argmax[0], argmax[1], argmax[2], -1, -1], [12, -1, -1, -1, -1],
                                 [argmax[3], argmax[4], 13, -1, -1]]
    assert ours.tolist()[4] == [argmax[9], -1, -1, -1, -1]
    # In a batch with sampled requests, the greedy rows are still vLLM's.
    mixed = _metadata([0.0, 0.8, 0.0, 0.8, 0.0])
    ours = _sample(rs, logits, drafts, counts, bonus, mixed, True, monkeypatch)
    vllm = _sample(rs, logits, drafts, counts, bonus, mixed, False, monkeypatch)
    assert torch.equal(ours[[0, 2, 4]], vllm[[0, 2, 4]])


def test_sampled_tokens_follow_the_target(rs, monkeypatch):
    """Three positions of one request, 20000 times in one batch: the first emitted token follows ``p1``; the
    second, where the first was the draft, ``p2``; the third, where both were, ``p3`` (the bonus row)."""
    p1 = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    p2 = torch.tensor([0.3, 0.1, 0.1, 0.5, 0.0])  # the draft (3) likely; token 4 impossible
    p3 = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    n = 20000
    logits = torch.stack([p1.log(), p2.log()]).repeat(n, 1).contiguous()
    torch.manual_seed(1)
    bonus = torch.multinomial(p3, n, replacement=True).tolist()
    out = _sample(rs, logits, [1, 3] * n, [2] * n, bonus, _metadata([1.0] * n), True, monkeypatch).long()

    def close(tokens, p):
        counts = torch.bincount(tokens, minlength=5).double()
        expected = p.double() * len(tokens)
        sd = (expected * (1 - p.double())).sqrt()
        assert ((counts - expected).abs() <= 5 * sd + 1e-9).all(), (counts, expected)

    close(out[:, 0], p1)
    second = out[out[:, 0] == 1]
    close(second[:, 1], p2)
    third = second[second[:, 1] == 3]
    close(third[:, 2], p3)
    assert len(third) == pytest.approx(n * 0.4 * 0.5, rel=0.05)
    # A request keeps nothing past its first rejected token.
    assert ((out[:, 0] != 1) <= (out[:, 1] == -1)).all() and ((second[:, 1] != 3) <= (second[:, 2] == -1)).all()


def test_seeded_requests_emit_what_vllm_emits(rs, monkeypatch):
    """Requests with their own generator draw vLLM's numbers in vLLM's order: the same tokens, this step and the
    next (the generators end where vLLM's end); unseeded and greedy requests beside them."""
    torch.manual_seed(2)
    counts = [3, 0, 3, 2, 3, 1] * 5
    logits = torch.randn(sum(counts), 64) * 2
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(len(argmax)) < 0.6, argmax, torch.randint(0, 64, argmax.shape)).tolist()
    temperature = [0.7, 0.7, 0.9, 0.0, 1.0, 0.8] * 5
    seeded = [i for i, t in enumerate(temperature) if t > 0 and i % 3 != 2]
    from lookahead_vllm.ops import sampling

    calls = []
    sample = sampling.sample_drafted
    monkeypatch.setattr(sampling, "sample_drafted", lambda *a: calls.append(1) or sample(*a))
    outs = []
    for lookahead in (True, False):
        generators = {i: torch.Generator().manual_seed(100 + i) for i in seeded}
        out = _sample(rs, logits.clone(), drafts, counts, list(range(30)), _metadata(temperature, generators),
                      lookahead, monkeypatch)
        outs.append((out[seeded + [3, 9, 15]], [float(torch.rand(1, generator=g)) for g in generators.values()]))
    assert calls == [1]
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
    assert (outs[0][0][:, 1:] == -1).any() and (outs[0][0][:, 1:] != -1).any()  # some rejected, some kept


def test_outside_a_lookahead_step_vllm_samples(rs, monkeypatch):
    calls = []
    monkeypatch.setattr("lookahead_vllm.ops.sampling.sample_drafted", lambda *a: calls.append(1))
    logits = torch.randn(3, 64)
    out = _sample(rs, logits, [1, 2, 3], [3], [4], _metadata([0.8]), False, monkeypatch)
    assert out.shape == (1, 4) and not calls


def test_sample_drafted_without_vllm_rows():
    """A batch of requests that drafted nothing emits each its bonus token."""
    out = sample_drafted(torch.zeros(0, dtype=torch.int32), [0, 0], torch.zeros(0, 10), torch.tensor([[4], [5]]),
                         np.array([False, True]), {}, 2)
    assert out.tolist() == [[4, -1, -1], [5, -1, -1]]


@pytest.mark.parametrize("scale", [0.2, 1.0, 3.0, 8.0])  # flat (the sort's fallback) to peaked rows
def test_nucleus_masks_what_vllms_sort_masks(rs, scale):
    """Top-p, top-k and both, per row (p 1 and k the vocabulary: that filter off), against vLLM's sort."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from lookahead_vllm.ops.sampling import nucleus_

    gen = torch.Generator().manual_seed(int(scale * 10))
    rows, vocab = 240, 5000
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[::7, :40] = logits[::7, :1]  # ties at the top
    p = torch.tensor([0.5, 0.9, 0.95, 1.0])[torch.arange(rows) % 4]
    k = torch.tensor([vocab, 1, 20, 300, vocab, 50])[torch.arange(rows) % 6]
    for top_k in (None, k):
        sorted_rows = []

        def sort(*args):
            sorted_rows.append(len(args[0]))
            return apply_top_k_top_p_pytorch(*args)

        ours = nucleus_(logits.clone(), top_k, p, sort)
        vllm = apply_top_k_top_p_pytorch(logits.clone(), top_k, p)
        assert torch.equal(ours.isfinite(), vllm.isfinite()), (ours.isfinite() != vllm.isfinite()).nonzero()[:5]
        assert torch.equal(ours[ours.isfinite()], logits[ours.isfinite()])  # kept logits unchanged
        kept = vllm.isfinite().sum(-1)
        # Rows keeping up to 4096 tokens are masked from candidates, without the sort (k-th ties aside).
        assert sum(sorted_rows) <= int((kept >= 4000).sum()) + int((kept == k).sum() if top_k is not None else 0)
        if scale == 1.0:
            assert ((kept > 256) & (kept < 4000)).any()  # the second candidate set is exercised


def test_draft_rows_masked_as_vllm_masks_them(rs, monkeypatch):
    """``apply_sampling_constraints`` in a lookahead step (temperature, then per-request top-k/top-p over each
    request's draft rows) gives vLLM's logits; with a seeded request in the step, vLLM's function runs."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from lookahead_vllm.ops import sampling

    batch, counts = 4, [3, 1, 0, 2]
    torch.manual_seed(4)
    logits = torch.randn(sum(counts), 3000) * 4
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)

    def metadata(generators):
        return SamplingMetadata(
            temperature=torch.tensor([0.8, 0.0, 1.2, 0.6]), all_greedy=False, all_random=False,
            top_p=torch.tensor([0.9, 1.0, 0.5, 0.95]), top_k=torch.tensor([3000, 3000, 40, 20]),
            generators=generators, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
            repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
            logprob_token_ids=None, spec_token_ids=None, thinking_budget_state_holder=None)

    calls = []
    nucleus = sampling.nucleus_
    monkeypatch.setattr(sampling, "nucleus_", lambda *a: calls.append(1) or nucleus(*a))
    for generators, used in (({}, [1]), ({3: torch.Generator()}, [1])):
        outs = []
        monkeypatch.setattr(patches, "_seeded_step", bool(generators))
        for lookahead in (True, False):
            monkeypatch.setattr(patches, "_lookahead_sampling", lookahead)
            outs.append(rs.apply_sampling_constraints(logits.clone(), cu, metadata(generators)))
        assert torch.equal(outs[0].isfinite(), outs[1].isfinite()) and torch.equal(outs[0], outs[1])
        assert calls == used
    kept = outs[0].isfinite().sum(-1).tolist()
    assert kept[3] == 3000 and all(0 < n < 20 for n in kept[4:])  # no filter; top-p within the top 20


def test_one_token_rows_masked_as_vllm_masks_them(rs, monkeypatch):
    """vLLM's sampler (a bonus row, a row of a step without drafts) in a lookahead step: its top-p/top-k masks are
    ``nucleus_``'s and equal vLLM's (the processed logits it returns), and every token sampled is one the mask
    keeps; with a seeded request in the step, or outside a lookahead step, vLLM's sort runs."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from lookahead_vllm.ops import sampling

    sampler = TopKTopPSampler("processed_logits")
    torch.manual_seed(5)
    logits = torch.randn(6, 3000) * 4
    p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.8, 0.7])
    k = torch.tensor([3000, 3000, 40, 20, 3000, 5])
    calls = []
    nucleus = sampling.nucleus_
    monkeypatch.setattr(sampling, "nucleus_", lambda *a: calls.append(1) or nucleus(*a))
    for top_k in (None, k):
        outs = {}
        for lookahead, seeded in ((True, False), (True, True), (False, False)):
            monkeypatch.setattr(patches, "_lookahead_sampling", lookahead)
            monkeypatch.setattr(patches, "_seeded_step", seeded)
            tokens, masked = sampler(logits.clone(), {}, top_k, p)
            assert masked[torch.arange(6), tokens].isfinite().all()
            outs[lookahead, seeded] = masked
        assert torch.equal(outs[True, False], outs[False, False]) and torch.equal(outs[True, True], outs[False, False])
    assert len(calls) == 2  # once a batch: in the lookahead step without a seeded request
    kept = outs[True, False].isfinite().sum(-1).tolist()
    assert kept[1] == 3000 and all(0 < n <= 40 for n in kept[2:4]) and kept[5] <= 5
