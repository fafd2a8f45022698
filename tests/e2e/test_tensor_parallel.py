"""Tensor parallel 2 on the CPU: lookahead stays lossless, and every rank drafts the same.

Under TP every rank (a worker process) runs its own drafter on the same
tokens; tree verification uses each rank's own step plan, so ranks must
draft identically. Each engine runs in its own subprocess (this file run as
a script: one ``LLM`` per process, its own environment), SmolLM2-135M fp32:

* greedy token ids of lookahead TP=2 == plain TP=2 == plain TP=1, for chains
  (``draft_shape="one"``) and trees (``"hier"``, trie as a second source so
  that drafts branch);
* the per-rank draft traces (:mod:`lookahead_vllm.vllm.draft_trace`) of a
  TP=2 run are identical step by step;
* the comparer (:mod:`lookahead_lab.draft_traces`) catches a rank whose
  drafts differ (unit tests, no vLLM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lookahead_lab import draft_traces
from lookahead_vllm.vllm import draft_trace

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 48
NUM_PROMPTS = 6
RUN_TIMEOUT_S = 600
# What runs TP=2 on a 2-core CPU box: the engine in-process, vLLM's
# multiprocess executor (it spawns one worker per rank, gloo between them),
# one OpenMP thread per rank and no thread binding.
TP_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NUMBA_THREADING_LAYER": "workqueue",
    "TOKENIZERS_PARALLELISM": "false",
}


# ---------------------------------------------------------------- the comparer (no vLLM)


def _write_rank(directory: Path, rank: int, steps: list[tuple[list[str], list[list[int]]]]) -> None:
    with open(directory / f"rank{rank}-{1000 + rank}{draft_trace.SUFFIX}", "w") as f:
        for step, (req_ids, drafts) in enumerate(steps, start=1):
            f.write(f"{step} {draft_trace.draft_digest(req_ids, drafts)} {len(drafts)} "
                    f"{sum(map(len, drafts))}\n")


STEPS = [(["a", "b"], [[1, 2, 3], []]), (["a", "b"], [[4], [5, 6]]), (["b"], [[7, 8]])]


def test_identical_ranks_compare_equal(tmp_path):
    for rank in (0, 1):
        _write_rank(tmp_path, rank, STEPS)
    cmp = draft_traces.compare_traces(tmp_path)
    assert cmp.identical and cmp.steps == 3 and cmp.divergence is None
    assert draft_traces.main([str(tmp_path)]) == 0


@pytest.mark.parametrize("changed", [
    (["a", "b"], [[4], [5, 9]]),  # one token of one draft
    (["a", "b"], [[4], [5]]),  # a shorter draft
    (["b", "a"], [[4], [5, 6]]),  # the same drafts for other requests
])
def test_a_rank_with_a_different_draft_is_detected(tmp_path, changed):
    _write_rank(tmp_path, 0, STEPS)
    _write_rank(tmp_path, 1, [STEPS[0], changed, STEPS[2]])
    cmp = draft_traces.compare_traces(tmp_path)
    assert not cmp.identical
    assert cmp.divergence[0] == 2 and cmp.differing_steps == [2]
    assert cmp.divergence[1].startswith("rank0") and cmp.divergence[3].startswith("rank1")
    assert draft_traces.main([str(tmp_path)]) == 1


def test_a_rank_missing_a_step_is_detected(tmp_path):
    _write_rank(tmp_path, 0, STEPS)
    _write_rank(tmp_path, 1, STEPS[:2])
    cmp = draft_traces.compare_traces(tmp_path)
    assert cmp.divergence == (3, cmp.files[0], draft_traces.read_trace(tmp_path / cmp.files[0])[3],
                              cmp.files[1], "missing")


def test_one_trace_is_not_a_comparison(tmp_path):
    _write_rank(tmp_path, 0, STEPS)
    assert not draft_traces.compare_traces(tmp_path).identical
    assert draft_traces.main([str(tmp_path)]) == 2


def test_record_writes_one_line_per_step_only_when_enabled(tmp_path, monkeypatch):
    monkeypatch.setattr(draft_trace, "tp_rank", lambda: 0)  # no vLLM import here
    monkeypatch.delenv(draft_trace.TRACE_DIR_ENV, raising=False)
    assert draft_trace.directory() is None  # the proposer records nothing
    monkeypatch.setenv(draft_trace.TRACE_DIR_ENV, str(tmp_path / "traces"))
    draft_trace.record(1, ["a", None], [[1, 2], []], draft_trace.directory())
    draft_trace.record(2, ["a"], [[3]], draft_trace.directory())
    (path,) = (tmp_path / "traces").iterdir()
    assert path.name == f"rank0-{os.getpid()}{draft_trace.SUFFIX}"
    trace = draft_traces.read_trace(path)
    assert trace == {1: f"{draft_trace.draft_digest(['a', None], [[1, 2], []])} 2 2",
                     2: f"{draft_trace.draft_digest(['a'], [[3]])} 1 1"}


# ---------------------------------------------------------------- TP=2 engines (vLLM, subprocesses)


def run_engine(model: str, tp: int, method: str, shape: str | None, out: Path, trace_dir: Path | None = None,
               timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """Greedy token ids of one engine, built and run in a subprocess (this file as a script)."""
    env = {**os.environ, **TP_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env.pop("LOOKAHEAD_VLLM_STATS_DIR", None)
    env.pop(draft_trace.TRACE_DIR_ENV, None)
    if trace_dir is not None:
        env[draft_trace.TRACE_DIR_ENV] = str(trace_dir)
    spec = json.dumps({"model": model, "tp": tp, "method": method, "shape": shape, "out": str(out)})
    proc = subprocess.run([sys.executable, __file__, spec], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"tp={tp} {method} {shape} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


# (name, tp, method, draft shape, traced)
RUNS = [
    ("plain-tp1", 1, "plain", None, False),
    ("plain-tp2", 2, "plain", None, False),
    ("one-tp2", 2, "lookahead", "one", True),
    ("hier-tp2", 2, "lookahead", "hier", True),
]


@pytest.fixture(scope="module")
def tp_runs(tiny_llama_dir, tmp_path_factory) -> dict[str, dict]:
    """Every run of :data:`RUNS`, one engine at a time; traced runs keep their trace directory."""
    out = {}
    for name, tp, method, shape, traced in RUNS:
        d = tmp_path_factory.mktemp(name)
        trace_dir = d / "traces" if traced else None
        out[name] = {**run_engine(tiny_llama_dir, tp, method, shape, d / "out.json", trace_dir),
                     "trace_dir": trace_dir}
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_plain_tp2_matches_tp1(tp_runs):
    assert tp_runs["plain-tp2"]["token_ids"] == tp_runs["plain-tp1"]["token_ids"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["one", "hier"])
def test_lookahead_tp2_greedy_identical(tp_runs, shape):
    run = tp_runs[f"{shape}-tp2"]
    assert run["token_ids"] == tp_runs["plain-tp2"]["token_ids"]
    assert run["token_ids"] == tp_runs["plain-tp1"]["token_ids"]
    # It really drafted, and verification accepted drafts (the second pass repeats the first).
    assert run["spec"]["vllm:spec_decode_num_accepted_tokens"] > NUM_PROMPTS * MAX_TOKENS // 4
    if shape == "hier":  # trees: some nodes were rejected, and output stayed identical
        assert run["spec"]["vllm:spec_decode_num_draft_tokens"] > run["spec"]["vllm:spec_decode_num_accepted_tokens"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["one", "hier"])
def test_every_rank_drafts_the_same(tp_runs, shape):
    trace_dir = tp_runs[f"{shape}-tp2"]["trace_dir"]
    cmp = draft_traces.compare_traces(trace_dir)
    assert sorted(f.split("-")[0] for f in cmp.files) == ["rank0", "rank1"]
    assert cmp.identical, f"ranks drafted differently: {cmp.divergence}"
    drafted = sum(int(line.split()[3]) for line in (trace_dir / cmp.files[0]).read_text().splitlines())
    assert drafted > 0


def _engine_main(spec: dict) -> None:
    from vllm import LLM, SamplingParams

    from lookahead_lab.datasets import load_humaneval, load_mtbench
    from lookahead_lab.offline import engine_kwargs

    lookahead = None
    if spec["method"] == "lookahead":
        # Trees: the trie as a second source, so drafts branch (the index alone gives one path here).
        lookahead = {"draft_shape": spec["shape"], **({"source": "index+trie"} if spec["shape"] != "one" else {})}
    kwargs = engine_kwargs(spec["method"], k=8, lookahead=lookahead, max_model_len=1024,
                           tensor_parallel_size=spec["tp"])
    if spec["tp"] > 1:
        kwargs["distributed_executor_backend"] = "mp"
    prompts = load_humaneval(NUM_PROMPTS // 2) + load_mtbench(NUM_PROMPTS // 2)
    llm = LLM(model=spec["model"], **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    # A random model's text never repeats itself, so the first pass drafts little; the second
    # pass (same prompts, reversed) drafts whole earlier answers from the index's corpus.
    ids = []
    for batch in (prompts, prompts[::-1]):
        ids += [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    Path(spec["out"]).write_text(json.dumps({"token_ids": ids, "spec": _spec_counters(llm)}))


def _spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


if __name__ == "__main__":
    _engine_main(json.loads(sys.argv[1]))
