"""Greedy verification from one argmax (``patches.greedy_sample``) gives vLLM's samplers' tokens.

* ``row_argmax`` (vLLM's CPU ``greedy_argmax`` op, or numpy without it) is torch's
  ``argmax(dim=-1)``: the first of equal maxima, the first NaN, half precision included;
* ``greedy_verify`` is vLLM's own greedy ``rejection_sample`` (run here on the CPU), batch by
  batch, drafts of every length (none included), accepted or not;
* ``greedy_sample`` leaves every step that vLLM's samplers must take to them: sampling that is
  not greedy, logprobs, penalties, bad words, allowed tokens, a ``min_tokens`` not reached, logit bias, a
  thinking budget, a custom logits processor, a GPU, asynchronous scheduling, an acceptance
  rule other than vLLM's standard one;
* ``min_tokens`` and logit bias are read from vLLM's own processors' state: a step takes the
  argmax while none of its requests is under its ``min_tokens`` or carries a bias (held to vLLM's
  own ``InputBatch`` as requests join, leave and reach their ``min_tokens``).

A real engine's steps are compared one by one in ``tests/e2e/test_greedy_sampling.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_vllm.ops.sampling import greedy_verify, row_argmax
from lookahead_vllm.vllm import patches


def _greedy_argmax_op():
    op = patches._cpu_greedy_argmax()
    if op is None:
        pytest.skip("vLLM's CPU greedy_argmax op: a CPU build of vLLM")
    return op


@pytest.mark.parametrize("with_op", [True, False], ids=["vllm-op", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_argmax_is_torchs(dtype, with_op):
    op = _greedy_argmax_op() if with_op else None
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 300, generator=gen).to(dtype)
    logits[1, [7, 40, 200]] = 50.0  # equal maxima: the first wins
    logits[2] = float("-inf")  # all equal
    logits[3, 11] = float("nan")
    logits[3, 90] = float("nan")  # the first NaN
    logits[4, :] = 1.0
    logits[5, 299] = 1e4
    got = row_argmax(logits, op)
    assert got.dtype == np.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[1] == 7 and got[3] == 11 and got[5] == 299


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_row_argmax_is_vllms_cpu_greedy_argmax(rows):
    """vLLM's CPU sampler takes greedy tokens with its own op (float32 logits only): numpy's
    argmax (row_argmax without the op) follows the same rule."""
    greedy_argmax = _greedy_argmax_op()
    gen = torch.Generator().manual_seed(rows)
    for fill in ("random", "ties", "nan", "inf", "-inf", "equal"):
        logits = torch.randn(rows, 49152, generator=gen)
        if fill == "ties":
            logits[:, [7, 4000, 40000]] = 50.0
        elif fill == "nan":
            logits[:, [11, 900]] = float("nan")
        elif fill in ("inf", "-inf"):
            logits[:, [5, 9]] = float(fill)
        elif fill == "equal":
            logits[:] = 1.0
        assert row_argmax(logits).tolist() == greedy_argmax(logits).tolist(), fill


def _cpu_rejection_sample():
    """vLLM's ``rejection_sample`` with its CPU kernels registered (once per process)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU kernels: a CPU build of vLLM")
    # As an engine's process: vLLM's expand kernel fixed before the overrides register it (they are registered once a
    # process, so a later test sampling at T > 0 reads the fixed one).
    assert patches.apply("cpu_expand_kernel") and patches.apply("cpu_kernel_overrides_once")
    current_platform.register_triton_kernel_overrides()
    return rejection_sampler.rejection_sample


@st.composite
def batches(draw):
    vocab = draw(st.integers(2, 12))
    counts = draw(st.lists(st.integers(0, 6), min_size=1, max_size=6))
    if not any(counts):  # vLLM runs its rejection sampler only on steps with a draft
        counts[draw(st.integers(0, len(counts) - 1))] = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    hit = draw(st.floats(0.0, 1.0))  # how often a draft is the target's token
    return vocab, counts, seed, hit


@settings(max_examples=150, deadline=None)
@given(batches())
def test_greedy_verify_is_vllms_greedy_rejection_sampling(batch):
    rejection_sample = _cpu_rejection_sample()
    vocab, counts, seed, hit = batch
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((sum(counts) + len(counts), vocab)).astype(np.float32))
    sampled = np.cumsum(np.asarray(counts) + 1)  # the rows of request i end at sampled[i]
    bonus_rows = sampled - 1
    target_rows = np.concatenate([np.arange(end - 1 - n, end - 1) for end, n in zip(sampled, counts)]).astype(np.int64)
    argmax = row_argmax(logits, patches._cpu_greedy_argmax())  # the op the patch uses, where there is one
    drafts = np.where(rng.random(len(target_rows)) < hit, argmax[target_rows],
                      rng.integers(0, vocab, len(target_rows))).astype(np.int32)
    width = max(counts)
    got = greedy_verify(argmax, drafts, np.asarray(counts), target_rows, bonus_rows, width)
    bonus = torch.from_numpy(argmax[bonus_rows]).view(-1, 1)
    want = rejection_sample(torch.from_numpy(drafts), counts, width,
                            torch.from_numpy(np.cumsum(counts).astype(np.int32)), None,
                            logits[torch.from_numpy(target_rows)], bonus,
                            SimpleNamespace(all_greedy=True, all_random=False))
    assert got.dtype == np.int32 and got.shape == (len(counts), width + 1)
    assert got.tolist() == want.tolist()


# ----------------------------------------------------------------- when vLLM's samplers run


def _processors(min_toks=None, biases=None):
    """vLLM's built-in min_tokens and logit_bias processors holding the given requests."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    min_tokens = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    logit_bias = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    min_tokens.min_toks.update(min_toks or {})
    logit_bias.biases.update(biases or {})
    return [min_tokens, logit_bias]


def _runner(processors=None, **metadata):
    """A stand-in runner whose batch samples greedily with nothing else."""
    sm = SimpleNamespace(**{
        "all_greedy": True, "max_num_logprobs": None, "logprob_token_ids": None, "no_penalties": True,
        "allowed_token_ids_mask": None, "bad_words_token_ids": {}, "thinking_budget_state_holder": None,
        "logitsprocs": SimpleNamespace(non_argmax_invariant=processors or _processors()), **metadata})
    return SimpleNamespace(input_batch=SimpleNamespace(sampling_metadata=sm),
                           use_async_scheduling=False, rejection_sampler=SimpleNamespace(synthetic_mode=False),
                           speculative_config=SimpleNamespace(rejection_sample_method="standard"))


def _ints(*values):
    return torch.tensor(values, dtype=torch.int32)


def _meta():
    """A step in which request 0 drafted [1, 2] and request 1 nothing: rows 0-1 are request 0's
    drafts' targets, row 2 its bonus, row 3 request 1's bonus."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    return SpecDecodeMetadata(draft_token_ids=_ints(1, 2), num_draft_tokens=[2, 0], cu_num_draft_tokens=_ints(2, 2),
                              cu_num_sampled_tokens=_ints(3, 4), target_logits_indices=_ints(0, 1),
                              bonus_logits_indices=_ints(2, 3), logits_indices=_ints(0, 1, 2, 3))


def _logits():
    # Greedy tokens 1, 0, 2, 2: request 0's first draft is accepted, its second (2, the target 0) not.
    return torch.tensor([[0.0, 5.0, 1.0], [7.0, 0.0, 1.0], [0.0, 0.0, 9.0], [0.0, 0.0, 4.0]])


def test_a_step_with_drafts_is_verified_from_the_argmax():
    out = patches.greedy_sample(_runner(), _logits(), _meta())
    assert out is not None and out.logprobs_tensors is None
    assert out.sampled_token_ids.dtype == torch.int32
    assert out.sampled_token_ids.tolist() == [[1, 0, -1], [2, -1, -1]]


def test_a_step_without_drafts_keeps_vllms_plain_sampler():
    assert patches.greedy_sample(_runner(), _logits(), None) is None


class _Holder:
    def __init__(self, tracked):
        self.tracked = tracked

    def has_tracked_requests(self):
        return self.tracked


class _CustomProcessor:
    pass


@pytest.mark.parametrize("metadata", [
    {"all_greedy": False}, {"max_num_logprobs": 0}, {"logprob_token_ids": {0: [1]}}, {"no_penalties": False},
    {"allowed_token_ids_mask": torch.zeros(2, 3, dtype=torch.bool)}, {"bad_words_token_ids": {0: [[2]]}},
    {"thinking_budget_state_holder": _Holder(True)},
    {"logitsprocs": SimpleNamespace(non_argmax_invariant=[_CustomProcessor()])},
], ids=lambda m: next(iter(m)))
def test_a_batch_that_needs_vllms_samplers_gets_them(metadata):
    assert patches.greedy_sample(_runner(**metadata), _logits(), _meta()) is None


def test_an_idle_thinking_budget_keeps_the_argmax():
    assert patches.greedy_sample(_runner(thinking_budget_state_holder=_Holder(False)), _logits(), _meta()) is not None


@pytest.mark.parametrize("held", [{"min_toks": {1: (4, [], {0}, False)}}, {"biases": {1: {2: 9.0}}}],
                         ids=["min_tokens", "logit_bias"])
def test_one_request_with_a_processor_sends_the_batch_to_vllms_samplers(held):
    assert patches.greedy_sample(_runner(_processors(**held)), _logits(), _meta()) is None


def test_a_builtin_processor_without_its_state_sends_the_batch_to_vllms_samplers():
    """Another vLLM whose processor keeps no ``min_toks`` / ``biases``: fail closed."""
    for i in range(2):
        processors = _processors()
        del vars(processors[i])["min_toks" if i == 0 else "biases"]
        assert patches.greedy_sample(_runner(processors), _logits(), _meta()) is None


def test_asynchronous_scheduling_gpus_and_other_acceptance_rules_keep_vllms_samplers():
    runner = _runner()
    runner.use_async_scheduling = True
    assert patches.greedy_sample(runner, _logits(), _meta()) is None
    logits = SimpleNamespace(device=torch.device("cuda"))  # never read: the device decides first
    assert patches.greedy_sample(_runner(), logits, _meta()) is None
    runner = _runner()
    runner.speculative_config.rejection_sample_method = "synthetic"
    assert patches.greedy_sample(runner, _logits(), _meta()) is None
    runner = _runner()
    runner.rejection_sampler.synthetic_mode = True
    assert patches.greedy_sample(runner, _logits(), _meta()) is None
    assert patches.greedy_sample(_runner(), _logits(), _meta()) is not None


def test_the_output_carries_the_argmax_it_was_verified_from():
    """Tree verification reads the tree rows' greedy targets from it (``TreeVerifier.finish_step``)."""
    out = patches.greedy_sample(_runner(), _logits(), _meta())
    assert out.logits_argmax.tolist() == [1, 0, 2, 2]


# ------------------------------------------------- min_tokens and logit bias, from vLLM's processors


def test_the_processors_state_follows_vllms_input_batch():
    """What reading the processors rests on: vLLM's ``InputBatch`` brings its ``min_tokens`` and
    ``logit_bias`` processors up to date in ``refresh_metadata`` (before every forward), so the
    argmax is taken exactly while no request of the batch carries a bias or is under its
    ``min_tokens``: a biased request joins and leaves, a ``min_tokens`` request reaches its minimum."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
                       vocab_size=32, block_sizes=[16], max_num_blocks_per_req=[4],
                       logitsprocs=LogitsProcessors(_processors()))
    runner = _runner()
    runner.input_batch = batch

    def state(req_id, **params):
        return CachedRequestState(req_id=req_id, prompt_token_ids=[1, 2, 3], mm_features=[],
                                  sampling_params=SamplingParams(temperature=0.0, **params), generator=None,
                                  block_ids=([0],), num_computed_tokens=0, output_token_ids=[])

    def takes_argmax(change=None):
        if change is not None:
            change()
            batch.condense()
        batch.refresh_metadata()
        return patches.greedy_sample(runner, _logits(), _meta()) is not None

    assert takes_argmax(lambda: batch.add_request(state("a")))
    assert not takes_argmax(lambda: batch.add_request(state("b", logit_bias={1: 5.0})))
    assert not takes_argmax()
    assert takes_argmax(lambda: batch.remove_request("b"))
    c = state("c", min_tokens=2)
    assert not takes_argmax(lambda: batch.add_request(c))
    c.output_token_ids.append(7)
    assert not takes_argmax()
    c.output_token_ids.append(8)  # its minimum reached: the processor drops it
    assert takes_argmax()
