"""bench_offline's drafter access through an engine core in its own process.

bench_gpu runs every CUDA-graph engine in its own engine core process (in one
process vLLM 0.32's graph engines share globals and fail to capture), and
reaches the drafters there over ``collective_rpc`` (``bench_offline.on_engine``).
The GPU machines cannot run this test first: it runs here, on the CPU, with the
same code path.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # 29 s: the lab harness's engine-process probe
def test_drafters_reached_in_an_engine_process(tmp_path, monkeypatch):
    import bench_offline as offline
    from vllm import SamplingParams

    from lookahead_lab.models import build_tiny_llama
    from lookahead_lab.offline import generate

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    model = build_tiny_llama(tmp_path / "tiny")
    args = SimpleNamespace(model=str(model), k=None, lookahead_config={}, prefix_caching="off", variants={},
                           max_model_len=None, engine_overrides={"enforce_eager": True})
    llm = offline.build_engine("lookahead", args)
    try:
        from vllm.v1.engine.core_client import InprocClient

        assert not isinstance(llm.llm_engine.engine_core, InprocClient)  # really another process
        # The proposer is reached in the engine process (a walk from this process's LLM finds none: None).
        assert offline.drafter_size(llm) == 0  # build_engine forgot the warm-up text
        prompt = "a b c d e f g a b c d e f g a b c d e f g a b c d"
        generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=24), batch_size=1)
        counters = offline.drafter_counters(llm)  # a Counter of plain ints came back (a Counter itself hangs)
        assert counters["steps"] > 0 and counters["request_steps"] > 0
        offline.reset_drafters(llm)  # over the same RPC
        assert offline.drafter_size(llm) == 0
        assert offline.drafter_counters(llm)["steps"] >= counters["steps"]  # the engine still answers
    finally:
        offline.free_engine(llm)
