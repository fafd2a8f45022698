"""benchmarks/bench_gpu.py cannot rot before a GPU comes: its CPU dry mode runs every part's code
(tiny model, tiny sizes; the CUDA parts say they were skipped) and writes JSON + PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.vllm
def test_bench_gpu_dry_run_reports_every_part(tiny_llama_dir, tmp_path):
    out = tmp_path / "gpu_dry.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), "--dry", "--model", tiny_llama_dir,
           "--plain-sync", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert list(parts) == ["kernels", "identity", "speed", "cost"] and not report["partial"]
    assert "no CUDA GPU" in parts["kernels"]["skipped"]
    # identity: every lookahead variant against plain, both batch sizes, 0 mismatches
    identity = parts["identity"]
    assert [c["batch_size"] for c in identity["cells"]] == [1, 2] and identity["mismatches"] == 0
    assert {r["method"] for r in identity["cells"][0]["methods"]} == {
        "lookahead:chain", "lookahead:hier", "lookahead:index+jacobi"}
    assert "CUDA graphs" in identity["graphs_skipped"]
    assert identity["plain_batch_variance"] == {"eager": 0}  # fp32 on a CPU: plain is batch-invariant
    assert all(r["divergences"] == [] for c in identity["cells"] for r in c["methods"])
    # speed: every cell has plain and the three variants; a summary per batch size
    speed = parts["speed"]
    assert speed["cells"] and all({"plain", "plain-sync", "lookahead:chain", "lookahead:hier", "lookahead:index+jacobi"}
                                  <= {r["method"] for r in c["methods"]} for c in speed["cells"])
    assert set(speed["summary"]) == {"bs1", "bs2", "mismatches", "plain-sync_mismatches"}
    assert speed["summary"]["mismatches"] == 0 == speed["summary"]["plain-sync_mismatches"]
    assert speed["async_scheduling"]["plain-sync"] is False and speed["summary"]["bs1"]["plain-sync/plain"]
    # every row carries its engine's step periods: plain never has a drafted step; a row drafted in a
    # decode step only if it drafted at all, and the chains did in some cell
    for cell in speed["cells"]:
        periods = {r["method"]: r["step_periods"] for r in cell["methods"]}
        assert periods["plain"]["decode_draftless"]["steps"] > 0 and periods["plain"]["decode_drafted"]["steps"] == 0
        assert periods["plain"]["decode_draftless"]["median_ms"] > 0
        assert all(r["num_drafts"] or not r["step_periods"]["decode_drafted"]["steps"] for r in cell["methods"])
    assert any(r["step_periods"]["decode_drafted"]["steps"] for c in speed["cells"] for r in c["methods"]
               if r["method"] == "lookahead:chain")
    # cost: rows x draft sizes of one engine, relative to the one-row one-token step
    (model,) = parts["cost"]["models"]
    assert {(r["rows"], r["draft_tokens"]) for r in model["rows"]} == {(1, 0), (1, 1), (1, 3), (2, 0), (2, 1), (2, 3)}
    assert all(r["median_ms"] > 0 for r in model["rows"])
    assert out.with_suffix(".png").stat().st_size > 1000


def test_bench_gpu_prompt_file_round_trips(tmp_path, monkeypatch):
    """The GPU machines lack the data packages: the exported file stands in for them."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    from lookahead_lab import datasets

    path = tmp_path / "prompts.json"
    bench_gpu.export_prompts(path, per_split=2)
    data = json.loads(path.read_text())
    assert set(data) == set(datasets.DATASETS) and all(len(d["test"]) == 2 for d in data.values())

    class Tokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(m["content"] for m in messages)

    args = bench_gpu.parse_args(["--prompts", str(path)])
    installed = bench_gpu.test_prompts(args, Tokenizer(), "humaneval", 2)

    def missing(*a, **k):
        raise datasets.MissingPackageError("not here")

    monkeypatch.setattr(datasets, "load_split", missing)
    assert bench_gpu.test_prompts(args, Tokenizer(), "humaneval", 2) == installed


def test_first_divergence_finds_where_outputs_part():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    assert bench_gpu.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench_gpu.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench_gpu.first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter output diverges where it stops
    assert bench_gpu.first_divergence([], [7]) == 0


def test_engine_settings_of_the_graph_and_variant_arguments():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)

    args = bench_gpu.parse_args(["--cudagraph-mode", "FULL", "--compile-backend", "eager",
                                 "--variants", "chain", "chain-ragged", "--ngram"])
    graphs = bench_gpu.engine_overrides(args, graphs=True)
    assert graphs["compilation_config"] == {"cudagraph_capture_sizes": bench_gpu.CAPTURE_SIZES,
                                            "backend": "eager", "cudagraph_mode": "FULL"}
    assert graphs["enforce_eager"] is False and graphs["dtype"] == "bfloat16"
    assert "compilation_config" not in bench_gpu.engine_overrides(args, graphs=False)
    assert bench_gpu.lookahead_methods(args) == ["lookahead:chain", "lookahead:chain-ragged"]
    assert args.ngram == []
    no_suffix = bench_gpu.parse_args(["--no-suffix", "--ngram"])
    assert bench_gpu.speed_baselines(no_suffix) == ([], {"suffix": "--no-suffix"})
    assert bench_gpu.VARIANTS["chain-ragged"]["_profile"] == {"uniform_steps": False}
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--variants", "tree"])


def test_a_baseline_engine_that_fails_to_build_is_left_out_and_named(monkeypatch):
    """The fourth H200 run lost its whole speed part to one baseline engine that failed to start:
    with ``failures`` given, a failing method is retried once, then left out with its error."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    calls = []

    def build(method, eargs):
        calls.append(method)
        if method == "suffix" or (method == "ngram8" and calls.count("ngram8") == 1):
            raise AssertionError("Error in memory profiling")
        return f"engine:{method}"

    monkeypatch.setattr(bench_gpu.offline, "build_engine", build)
    monkeypatch.setattr(bench_gpu, "on_gpu", lambda: False)
    monkeypatch.setattr(bench_gpu, "async_scheduling", lambda llm: None)  # the stand-ins are strings
    args = bench_gpu.parse_args(["--dry"])
    failures = {}
    engines = bench_gpu.build_engines(["ngram8", "suffix", "plain"], args, graphs=False, failures=failures)
    assert engines == {"ngram8": "engine:ngram8", "plain": "engine:plain"}  # ngram8 built on its retry
    assert failures == {"suffix": "AssertionError: Error in memory profiling"}
    assert calls == ["ngram8", "ngram8", "suffix", "suffix", "plain"]
    calls.clear()
    with pytest.raises(AssertionError):  # without failures (plain: part_speed passes none) the 2nd propagates
        bench_gpu.build_engines(["suffix"], args, graphs=False)
    assert calls == ["suffix", "suffix"]


def test_plain_sync_is_plain_with_async_scheduling_off(monkeypatch):
    """--plain-sync adds a baseline built as plain with ``async_scheduling`` False; every other
    engine keeps the overrides it had."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    built = []

    class Engine:
        def __init__(self, overrides):
            scheduler = SimpleNamespace(async_scheduling=overrides.get("async_scheduling"))
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=scheduler))

    def build(method, eargs, label=None):
        built.append((label or method, dict(eargs.engine_overrides)))
        return Engine(eargs.engine_overrides)

    monkeypatch.setattr(bench_gpu.offline, "build_engine", build)
    monkeypatch.setattr(bench_gpu, "on_gpu", lambda: False)
    args = bench_gpu.parse_args(["--plain-sync", "--no-suffix", "--ngram", "--variants"])
    assert bench_gpu.speed_baselines(args) == (["plain-sync"], {"suffix": "--no-suffix"})
    assert bench_gpu.lookahead_methods(args) == []
    engines = bench_gpu.build_engines(["plain", "plain-sync"], args, graphs=True)
    assert [m for m, _ in built] == ["plain", "plain-sync"]  # plain's engine, labelled in the log
    assert "async_scheduling" not in built[0][1] and built[1][1]["async_scheduling"] is False
    assert built[1][1]["compilation_config"] == built[0][1]["compilation_config"]
    assert engines["plain-sync"].llm_engine.vllm_config.scheduler_config.async_scheduling is False
    assert bench_gpu.parse_args([]).plain_sync is False  # off unless asked
    # vLLM's GPU n-gram drafter needs no numba: it stays where the kit's numba stub drops ngram
    monkeypatch.setitem(sys.modules, "numba", SimpleNamespace(__file__="/tmp/site/numba_stub/numba/__init__.py"))
    kept, skipped = bench_gpu.speed_baselines(bench_gpu.parse_args(["--no-suffix", "--ngram", "ngram8-w2-4",
                                                                    "ngram_gpu8-w2-4"]))
    assert kept == ["ngram_gpu8-w2-4"] and "numba" in skipped["ngram8-w2-4"]


def test_speed_summary_reports_plain_sync_and_runs_without_lookahead():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)

    def cell(bs, mismatches=0, **speedups):
        return {"batch_size": bs, "methods": [{"method": m, "speedup": v, "mismatches": mismatches * (m != "plain")}
                                              for m, v in {"plain": 1.0, **speedups}.items()]}

    summary = bench_gpu.speed_summary([cell(1, 3, **{"plain-sync": 0.5}), cell(1, **{"plain-sync": 0.8}),
                                       cell(8, **{"plain-sync": 0.9})])
    assert summary["bs1"]["plain-sync/plain"] == pytest.approx((0.5 * 0.8) ** 0.5, abs=1e-3)
    assert summary["bs8"] == {"lookahead/plain": None, "lookahead/suffix": None, "ngram/plain": None,
                              "ngram_gpu/plain": None, "plain-sync/plain": 0.9}
    assert summary["mismatches"] == 0 and summary["plain-sync_mismatches"] == 3  # its schedule's, apart
    mixed = bench_gpu.speed_summary([cell(1, 1, **{"lookahead:chain": 2.0, "suffix": 0.5, "ngram8-w2-4": 1.5,
                                                   "ngram16": 1.7, "ngram_gpu8-w2-4": 1.9})])
    assert mixed["bs1"] == {"lookahead/plain": 2.0, "lookahead/suffix": 4.0, "ngram/plain": 1.7,
                            "ngram_gpu/plain": 1.9, "plain-sync/plain": None}  # each n-gram drafter apart
    assert mixed["mismatches"] == 5  # one for each method beside plain


def test_step_clock_classifies_and_times_each_step(monkeypatch):
    """The step clock wraps the model runner's ``execute_model``: a step of decode rows only, without
    or with drafts, or with a prefill among them; the median period from one step's start to the
    next, none for the last step before a step of new rows only (a new ``generate`` call)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_offline
    finally:
        sys.path.pop(0)
    ticks = iter([0, 2_000_000, 5_000_000, 6_000_000, 10_000_000, 900_000_000, 903_000_000])
    monkeypatch.setattr(bench_offline.time, "perf_counter_ns", lambda: next(ticks))
    runner = SimpleNamespace(input_batch=object(), execute_model=lambda out: out.total_num_scheduled_tokens)
    worker = SimpleNamespace(worker=SimpleNamespace(model_runner=runner))  # what collective_rpc hands over

    def step(tokens, drafts, new=0):  # two rows; ``new`` of them admitted in this step
        out = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": tokens - 1}, total_num_scheduled_tokens=tokens,
                              scheduled_spec_decode_tokens=drafts, scheduled_new_reqs=[object()] * new)
        return runner.execute_model(out)

    bench_offline._start_step_clock(worker)
    assert step(2, {}, new=2) == 2  # the wrapped call still returns the runner's result
    step(2, {})
    step(5, {"b": [7, 8, 9]})  # 2 rows + 3 drafts: decode
    step(9, {"b": [7]}, new=1)  # a prefill chunk beside a decode row (one new row: the same call)
    runner.execute_model(SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                         scheduled_spec_decode_tokens={}, scheduled_new_reqs=[]))  # not a step
    step(2, {})  # ends its call: 888 ms until the next call's first step
    step(2, {}, new=2)
    step(2, {})
    assert bench_offline._read_step_clock(worker) == {
        "decode_draftless": {"steps": 3, "median_ms": 3.0},  # 2, 3 and 3 ms; not the 888 ms pause
        "decode_drafted": {"steps": 1, "median_ms": 1.0},
        "mixed": {"steps": 1, "median_ms": 4.0}}
    bench_offline._start_step_clock(worker)  # a second start clears the log, wraps once
    assert bench_offline._read_step_clock(worker)["mixed"] == {"steps": 0, "median_ms": None}
    with pytest.raises(StopIteration):
        step(2, {})  # the clock ran out: exactly one reading a step, so no second wrapper
    # no model runner under the root: nothing clocked, nothing read
    bench_offline._start_step_clock(SimpleNamespace())
    assert bench_offline._read_step_clock(SimpleNamespace())["decode_draftless"] == {"steps": 0, "median_ms": None}


def test_step_anatomy_splits_decode_steps_by_drafts_and_forward(monkeypatch):
    """The step clock also times the runner's forwards: decode steps grouped by the draft tokens they
    scored, each group's median period, forward and the rest; prefill steps and a call's last step
    left out."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_offline
    finally:
        sys.path.pop(0)
    now = [0]
    monkeypatch.setattr(bench_offline.time, "perf_counter_ns", lambda: now[0])

    def forward(ms):
        now[0] += ms * 1_000_000

    def execute(out):
        runner._model_forward(out.forward_ms)  # the forward runs inside execute_model
        now[0] += out.rest_ms * 1_000_000

    runner = SimpleNamespace(input_batch=object(), execute_model=execute, _model_forward=forward)
    root = SimpleNamespace(model_runner=runner)

    def step(drafts, forward_ms, rest_ms, prefill=0, new=0):
        out = SimpleNamespace(num_scheduled_tokens={"a": 1 + drafts + prefill}, forward_ms=forward_ms,
                              rest_ms=rest_ms, total_num_scheduled_tokens=1 + drafts + prefill,
                              scheduled_spec_decode_tokens={"a": [5] * drafts} if drafts else {},
                              scheduled_new_reqs=[object()] * new)
        runner.execute_model(out)

    bench_offline._start_step_clock(root)
    step(0, 30, 5, prefill=40, new=1)  # the prompt's prefill: a mixed step
    step(0, 30, 6)
    step(0, 34, 6)
    step(3, 36, 7)
    step(3, 38, 9)
    step(3, 40, 7)
    step(8, 45, 8)  # its call's last step: the next is a new call's
    step(0, 30, 5, prefill=40, new=1)
    assert bench_offline._read_step_anatomy(root) == {
        0: {"steps": 2, "median_ms": 38.0, "forward_median_ms": 32.0, "rest_median_ms": 6.0},
        3: {"steps": 3, "median_ms": 47.0, "forward_median_ms": 38.0, "rest_median_ms": 7.0}}
    assert bench_offline._read_step_clock(root)["mixed"] == {"steps": 1, "median_ms": 35.0}
    bench_offline._start_step_clock(root)  # a second start clears the log and keeps one forward timer
    step(2, 20, 4)
    step(2, 20, 4)
    assert bench_offline._read_step_anatomy(root) == {
        2: {"steps": 1, "median_ms": 24.0, "forward_median_ms": 20.0, "rest_median_ms": 4.0}}


def test_batch_invariance_is_asked_for_on_a_gpu_only(monkeypatch):
    """--batch-invariant sets VLLM_BATCH_INVARIANT for the engines on a GPU and is refused, naming
    why, where there is none (vLLM's batch-invariant kernels fail in a CPU engine)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_USE_FLASHINFER_SAMPLER",
                 "LOOKAHEAD_VLLM_GPU_TREES"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # preflight sets them: restored after the test
    # By hand, not monkeypatch: preflight sets it in os.environ, and a leaked 1 turns every later
    # engine in this process batch-invariant (which fails on a CPU).
    saved = os.environ.pop("VLLM_BATCH_INVARIANT", None)
    try:
        args = bench_gpu.parse_args(["--batch-invariant", "--identity-batch-sizes", "1", "8", "32"])
        assert args.identity_batch_sizes == [1, 8, 32] and bench_gpu.parse_args([]).identity_batch_sizes == [1, 8]
        with pytest.raises(SystemExit):
            bench_gpu.parse_args(["--identity-batch-sizes", "1", "0"])
        monkeypatch.setattr(bench_gpu, "on_gpu", lambda: False)
        assert "needs a CUDA GPU" in bench_gpu.preflight(args) and "VLLM_BATCH_INVARIANT" not in os.environ
        monkeypatch.setattr(bench_gpu, "on_gpu", lambda: True)
        bench_gpu.preflight(args)
        assert os.environ.pop("VLLM_BATCH_INVARIANT") == "1"
        bench_gpu.preflight(bench_gpu.parse_args([]))
        assert "VLLM_BATCH_INVARIANT" not in os.environ  # off unless asked
    finally:
        os.environ.pop("VLLM_BATCH_INVARIANT", None)
        if saved is not None:
            os.environ["VLLM_BATCH_INVARIANT"] = saved
