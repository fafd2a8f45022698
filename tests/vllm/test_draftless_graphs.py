"""Draftless graphs (profile ``draftless_graphs``), through vLLM's own dispatcher and runner code.

A speculative engine's full CUDA graphs hold decode steps of 1 + k tokens a
request; ``patches.draftless_graphs`` adds graphs for steps of one token a
request, captured and dispatched with the query length set to 1 for the call.
No CUDA here: the dispatcher is vLLM's real ``CudagraphDispatcher`` over a
config of the shape a GPU engine has, and the runner methods are vLLM's real
``GPUModelRunner`` methods, wrapped by the patch, called on a stand-in runner.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.vllm.test_proposer import make_proposer

pytestmark = pytest.mark.vllm

K = 8
MAX_SEQS = 32
# The capture sizes as vLLM 0.32 leaves them for k = 8 (multiples of 1 + k).
SIZES = [9, 18, 36, 72, 144, 288, 387]


def dispatcher():
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    compilation = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, cudagraph_capture_sizes=SIZES,
                                  max_cudagraph_capture_size=SIZES[-1], compile_sizes=[],
                                  is_attention_compiled_piecewise=lambda: True)
    config = SimpleNamespace(compilation_config=compilation, num_speculative_tokens=K, lora_config=None,
                             scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS))
    d = CudagraphDispatcher(config)
    d.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, 1 + K)
    return d


def runner(draftless_rows: int):
    """The state vLLM's ``_determine_batch_execution_and_padding`` and ``_warmup_and_capture``
    read, a real proposer as the drafter, and a ``_dummy_run`` that records what it was asked."""
    drafter = make_proposer(k=K)
    drafter.draftless_rows = draftless_rows
    r = SimpleNamespace(uniform_decode_query_len=1 + K, cudagraph_dispatcher=dispatcher(), drafter=drafter,
                        model_config=SimpleNamespace(is_encoder_decoder=False),
                        input_batch=SimpleNamespace(lora_id_to_lora_request={}),
                        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1),
                                                    observability_config=SimpleNamespace(cudagraph_metrics=False)),
                        compilation_config=SimpleNamespace(cudagraph_num_of_warmups=0), runs=[])
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    r._is_uniform_decode = GPUModelRunner._is_uniform_decode  # a staticmethod: read off the class
    r._dummy_run = lambda num_tokens, **kw: r.runs.append((num_tokens, kw["uniform_decode"],
                                                           r.uniform_decode_query_len))
    return r


@pytest.fixture(scope="module")
def runner_cls():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lookahead_vllm.vllm import patches

    assert patches.apply("draftless_graphs"), patches._failed
    return GPUModelRunner


def test_draftless_keys_sit_beside_the_filled_steps_keys():
    from vllm.config import CUDAGraphMode

    from lookahead_vllm.vllm.patches import add_draftless_keys

    d = dispatcher()
    filled = {x for x in d.cudagraph_keys[CUDAGraphMode.FULL]}
    # vLLM's own: one per size that MAX_SEQS requests of 1 + k tokens reach
    assert {(x.num_tokens, x.num_reqs) for x in filled} == {(s, s // (1 + K)) for s in SIZES if s <= MAX_SEQS * (1 + K)}
    added = add_draftless_keys(d, MAX_SEQS)
    assert [(x.num_tokens, x.num_reqs, x.uniform) for x in added] == [(9, 9, True), (18, 18, True)]
    assert d.cudagraph_keys[CUDAGraphMode.FULL] == filled | set(added)  # none replaced
    assert add_draftless_keys(d, MAX_SEQS) == added and len(d.cudagraph_keys[CUDAGraphMode.FULL]) == len(filled) + 2


def test_a_draftless_step_dispatches_to_its_own_full_graph(runner_cls):
    from vllm.config import CUDAGraphMode

    from lookahead_vllm.vllm.patches import add_draftless_keys

    def run(r, tokens, reqs, per_row):
        mode, desc, *_ = runner_cls._determine_batch_execution_and_padding(
            r, num_tokens=tokens, num_reqs=reqs, num_scheduled_tokens_np=np.full(reqs, per_row, np.int32),
            max_num_scheduled_tokens=per_row)
        assert r.uniform_decode_query_len == r.cudagraph_dispatcher.uniform_decode_query_len == 1 + K  # restored
        return mode, (desc.num_tokens, desc.num_reqs, desc.uniform)

    on = runner(draftless_rows=18)
    add_draftless_keys(on.cudagraph_dispatcher, MAX_SEQS)
    # 5 rows of one token: padded to the 9-request graph of one token each
    assert run(on, 5, 5, 1) == (CUDAGraphMode.FULL, (9, 9, True))
    # a filled step, 4 rows x 9 tokens: the filled steps' graph, as before
    assert run(on, 36, 4, 1 + K) == (CUDAGraphMode.FULL, (36, 4, True))
    # 30 rows of one token: past the largest draftless graph (18), piecewise
    assert run(on, 30, 30, 1)[0] == CUDAGraphMode.PIECEWISE
    off = runner(draftless_rows=0)  # the profile knob off: vLLM's own dispatch, piecewise
    add_draftless_keys(off.cudagraph_dispatcher, MAX_SEQS)
    assert run(off, 5, 5, 1)[0] == CUDAGraphMode.PIECEWISE


def test_draftless_graphs_are_captured_one_token_a_request(runner_cls):
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    r = runner(draftless_rows=18)
    for desc in (BatchDescriptor(num_tokens=18, num_reqs=18, uniform=True),
                 BatchDescriptor(num_tokens=18, num_reqs=2, uniform=True)):
        runner_cls._warmup_and_capture(r, desc, cudagraph_runtime_mode=CUDAGraphMode.FULL, num_warmups=0)
    # the draftless key captured with query length 1, the filled one with 1 + k; then restored
    assert r.runs == [(18, True, 1), (18, True, 1 + K)] and r.uniform_decode_query_len == 1 + K
