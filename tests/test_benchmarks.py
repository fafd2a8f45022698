"""The benchmark harnesses run end to end (tiny model, tiny settings) and write their outputs."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

import pytest

from lookahead_vllm.core.config import DEFAULT_DECODING_LENGTH, resolve
from tests.settings import lookahead

REPO = Path(__file__).resolve().parent.parent


def _import_bench(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


@pytest.mark.vllm
def test_bench_offline_runs_and_reports(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "bench_offline.py"), "--model", tiny_llama_dir,
        "--datasets", "humaneval", "mtbench", "--num-prompts", "2", "--max-tokens", "8", "--batch-sizes", "1",
        # Three engines: the CI host also holds the end-to-end tests' engines until they shut down.
        "--methods", "plain", "lookahead-warm", "--variant", "nofloor={\"_profile\": {\"min_draft_confidence\": 0}}",
        "--out", str(out), "--plot", str(tmp_path / "bench.png"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    # two datasets: shared engines keep working after per-cell engines shut down
    assert [cell["dataset"] for cell in report["cells"]] == ["humaneval", "mtbench"]
    for cell in report["cells"]:
        rows = {row["method"]: row for row in cell["methods"]}
        assert set(rows) == {"plain", "lookahead-warm", "lookahead:nofloor"}
        assert all(row["mismatches"] == 0 and row["tokens"] > 0 for row in rows.values())
        # "-warm" methods are preloaded with the dev split; the others start empty.
        assert rows["lookahead-warm"]["drafter_size_start"] > 0
        assert rows["lookahead:nofloor"]["drafter_size_start"] == 0
        # The lookahead engines report what their calibrators learned.
        assert rows["plain"]["calibration"] is None
        assert set(rows["lookahead:nofloor"]["calibration"]) == {"chain", "branch", "pool", "context"}
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "lookahead:nofloor" in proc.stdout


def test_trie_replay_measures_every_step():
    bench_trie = _import_bench("bench_trie")
    from lookahead_lab.reference.trie import TokenTrie

    streams = [([1, 2, 3, 4], [5, 6, 7, 8, 9]), ([1, 2, 3], [4, 5])]
    times = bench_trie.replay(TokenTrie(resolve()), streams, accept_per_step=2)
    assert len(times) == 3 + 1 and all(t > 0 for t in times)


def test_plot_sweep_groups_variants_by_shape_and_axis(tmp_path):
    """Variants named <shape>-<d|b><N> become one line per (axis, shape), sorted by N."""
    plot_sweep = _import_bench("plot_sweep")

    def row(method, speedup, mal):
        return {"method": method, "speedup": speedup, "mean_acceptance_length": mal}

    cell = {"dataset": "humaneval", "batch_size": 1, "methods": [
        row("plain", 1.0, None), row("ngram8", 1.3, 6.0), row("lookahead:hier-d16", 1.5, 2.3),
        row("lookahead:hier-d4", 1.4, 1.9), row("lookahead:one-d8", 1.8, 2.1), row("lookahead:hier-b8", 1.2, 2.0),
        row("lookahead:hier-d8-warm", 1.6, 2.4),
    ]}
    lines = plot_sweep.series(cell)
    assert sorted(lines) == [("b", "hier"), ("d", "hier"), ("d", "hier-warm"), ("d", "one")]
    assert [n for n, _ in lines[("d", "hier")]] == [4, 16]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"cells": [cell]}))
    plot_sweep.main([str(path)])
    assert (tmp_path / "s_sweep.png").stat().st_size > 1000
    # Two runs (e.g. chains and trees, each with its own plain) plot as one cell.
    other = {"cells": [{**cell, "methods": [row("plain", 1.0, None), row("lookahead:one-d64", 1.7, 2.2)]}]}
    rows = plot_sweep.merge([{"cells": [cell]}, other])["cells"][0]["methods"]
    assert [r["method"] for r in rows] == [r["method"] for r in cell["methods"]] + ["lookahead:one-d64"]
    assert rows[0]["speedup"] == 1.0 and len(plot_sweep.series({"methods": rows})[("d", "one")]) == 2


def test_forward_cost_fixed_tree_has_the_asked_paths():
    bench_forward_cost = _import_bench("bench_forward_cost")
    from lookahead_lab.reference.planner import opens_path

    tree = bench_forward_cost.fixed_tree(8, 3)
    assert len(tree) == 8 and tree.parents == (-1, 0, 1, -1, 3, 4, -1, 6)
    assert 1 + sum(opens_path(tree.parents)) == 3  # root-to-leaf paths
    assert bench_forward_cost.fixed_tree(8, 1).parents == tuple(range(-1, 7))  # a chain


def test_forward_cost_plot_draws_the_prior_beside_the_measured_curve(tmp_path):
    bench_forward_cost = _import_bench("bench_forward_cost")
    rows = [{"nodes": n, "tokens_scored": 12 * (n + 1), "median_ms": 280.0 + 5 * n, "relative": 1.9 + 0.04 * n}
            for n in (0, 1, 2, 4)]
    bench_forward_cost.plot(rows, tmp_path / "cost.png", batch=12)
    assert (tmp_path / "cost.png").stat().st_size > 1000


def test_forward_cost_drafting_mode_parses_and_plots(tmp_path):
    bench_forward_cost = _import_bench("bench_forward_cost")
    assert bench_forward_cost.parse_drafting("4x1", 8) == (4, 1)
    assert bench_forward_cost.parse_drafting("0X0", 8) == (0, 0)
    for bad, message in (("9x1", "rows must be in [0, --batch=8]"), ("4x0", "both 0 or both positive"),
                         ("four", "must be RxN")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            bench_forward_cost.parse_drafting(bad, 8)
    cells = [{"context": c, "batch": 8, "configs": [{"drafting_rows": r, "draft_tokens": n, "relative": 1 + 0.1 * r}
                                                    for r, n in ((0, 0), (1, 1), (8, 1))]} for c in (512, 2048)]
    bench_forward_cost.plot_drafting(cells, tmp_path / "ctx.png")
    assert (tmp_path / "ctx.png").stat().st_size > 1000


@pytest.mark.parametrize("argv,message", [
    (["--paths", "2", "--nodes", "8", "--batch", "8"], "--paths measures one request"),
    (["--batch", "0"], "--batch=0: must be in"),
])
def test_forward_cost_rejects_bad_arguments(argv, message, capsys):
    bench_forward_cost = _import_bench("bench_forward_cost")
    with pytest.raises(SystemExit):
        bench_forward_cost.main(argv)
    assert message in capsys.readouterr().err


def test_sim_acceptance_replays_the_trie_and_prices_paths():
    sim_acceptance = _import_bench("sim_acceptance")

    prompt, out = [1, 2, 3, 4, 5] * 4, [1, 2, 3, 4, 5] * 6
    chain = sim_acceptance.simulate({"draft_shape": "one"}, [prompt], [out], [])
    # The prompt's cycle continues: every step accepts several tokens; the
    # first output token comes from prefill and is not counted.
    assert chain["tokens"] == len(out) - 1 and chain["mal"] > 3
    # Chains open no paths: a step costs at most the token model's price of
    # 1 + decoding_length tokens, and drafts past the free region cost something.
    cost = sim_acceptance.batch1_cost(resolve())
    free_paths = sim_acceptance.batch1_cost(resolve(), (0.0, 0.0))  # --path-cost 0 0
    assert free_paths(9, 3) == cost(9, 0) < cost(9, 3)
    assert chain["mal"] / cost(1 + DEFAULT_DECODING_LENGTH, 0) <= chain["speed"] < chain["mal"]
    # Two continuations after "1 2": a tree can take either; paths cost time.
    prompt2 = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9] * 2
    out2 = [1, 2, 4, 9, 1, 2, 3, 9] * 3
    trie_only = dict(context_match=0, source="trie")  # the trie's trees alone (the context chain is checked below)
    free = dict(path_setup=0, cost_per_path=0)  # paths free when drafting (timed at the CPU's prices)
    hier = sim_acceptance.simulate(lookahead(draft_shape="hier", **free, **trie_only), [prompt2], [out2], [])
    one = sim_acceptance.simulate(lookahead(draft_shape="one", **trie_only), [prompt2], [out2], [])
    assert hier["off_chain_steps"] > 0 and one["off_chain_steps"] == 0
    assert hier["speed"] < hier["mal"]  # timed with the CPU path rounds' costs
    # The audit of the trie's raw confidences saw every retrieved node: the
    # leading chain's and the side branches' (off-chain accepts among them).
    audit = hier["raw_calibration"]
    branch_nodes = sum(r["nodes"] for r in audit["branch"])
    assert sum(r["nodes"] for r in audit["chain"]) > 0 and branch_nodes > 0
    assert 0 < sum(r["acceptance"] * r["nodes"] for r in audit["branch"]) < branch_nodes
    assert audit["pool"] == []
    # A long repeat of the prompt: the context chain drafts it past the trie's branch length.
    text = list(range(100, 140))
    short = dict(draft_shape="one", branch_length=4, max_match_length=2, cost_free_tokens=0)
    ctx = sim_acceptance.simulate(lookahead(**short, source="trie"), [text], [text], [])
    no_ctx = sim_acceptance.simulate(lookahead(**short, **trie_only), [text], [text], [])
    assert ctx["mal"] > no_ctx["mal"] + 1 and no_ctx["mal"] <= 4
    assert sum(r["nodes"] for r in ctx["raw_calibration"]["context"]) > 0
    assert no_ctx["raw_calibration"]["context"] == []


def test_sim_acceptance_batches_share_the_step_and_time_plain_over_the_same_waves(capsys):
    sim_acceptance = _import_bench("sim_acceptance")

    # Text that never repeats drafts nothing: lookahead's steps are plain's,
    # so the modeled speed is exactly 1 however the waves' lengths differ.
    prompts = [list(range(1000 * r, 1000 * r + 10)) for r in range(5)]
    outputs = [list(range(1000 * r + 10, 1000 * r + 10 + n)) for r, n in enumerate((7, 30, 12, 3, 20))]
    for batch in (1, 2, 8):
        r = sim_acceptance.simulate({}, prompts, outputs, [], batch=batch)
        assert r["nodes_per_step"] == 0 and r["speed"] == pytest.approx(1.0)
        assert r["tokens"] == sum(len(o) - 1 for o in outputs)
    # Repetitive requests: every token is emitted once at any batch size, and
    # at batch 8 (past the free tokens of the CPU model) the shared budget
    # keeps fewer nodes per request-step than one request alone drafts.
    cycle = [[7, 8, 9, 10 + r, 11 + r] for r in range(8)]
    prompts = [c * 4 for c in cycle]
    outputs = [c * 8 for c in cycle]
    alone = sim_acceptance.simulate({"draft_shape": "one"}, prompts, outputs, [], batch=1)
    shared = sim_acceptance.simulate({"draft_shape": "one"}, prompts, outputs, [], batch=8)
    assert alone["tokens"] == shared["tokens"] == sum(len(o) - 1 for o in outputs)
    assert 0 < shared["nodes_per_step"] < alone["nodes_per_step"]
    assert 1 < shared["speed"] < shared["mal"]
    with pytest.raises(SystemExit):
        sim_acceptance.main(["--batch", "0"])
    assert "--batch 0: must be >= 1" in capsys.readouterr().err


def test_sim_acceptance_mixed_traffic_reports_each_class(capsys):
    """Classes interleaved through one drafter: each class's steps and tokens add up to the run's, its speed is
    its own plain forwards over its own; a calibration per class is the shared one when there is one class."""
    sim_acceptance = _import_bench("sim_acceptance")
    rng = random.Random(0)
    cycle = [[7, 8, 9, 10 + r, 11 + r] for r in range(4)]
    prompts = [p for c in cycle for p in (c * 4, [rng.randrange(1, 4) for _ in range(20)])]
    outputs = [o for c in cycle for o in (c * 8, [rng.randrange(1, 4) for _ in range(60)])]
    classes = ["cycle", "noise"] * 4
    mixed = sim_acceptance.simulate({"draft_shape": "one"}, prompts, outputs, [], classes=classes)
    rows = mixed["by_class"]
    assert set(rows) == {"cycle", "noise"}
    for key in ("steps", "draft_tokens", "accepted_tokens"):
        assert sum(row[key] for row in rows.values()) == mixed[key]
    assert rows["noise"]["accepted_tokens"] < rows["noise"]["draft_tokens"] / 2  # random text: drafts mostly miss
    assert rows["cycle"]["speed"] > 2 * rows["noise"]["speed"] > 2  # repetition pays far more
    one = ["cycle"] * len(prompts)
    shared = sim_acceptance.simulate({"draft_shape": "one"}, prompts, outputs, [], classes=one)
    own = sim_acceptance.simulate({"draft_shape": "one"}, prompts, outputs, [], classes=one,
                                  per_class_calibration=True)
    assert own["by_class"] == shared["by_class"] and own["speed"] == shared["speed"]
    with pytest.raises(ValueError, match="classes with batch=2"):
        sim_acceptance.simulate({}, prompts, outputs, [], batch=2, classes=classes)
    with pytest.raises(SystemExit):
        sim_acceptance.main(["--per-class-calibration"])
    assert "--per-class-calibration needs --mixed" in capsys.readouterr().err


def test_bench_offline_refuses_runs_that_cannot_fit_in_memory(tiny_llama_dir):
    """Every method's engine is alive during a cell; too many for the host is a clear error before any work."""
    bench_offline = _import_bench("bench_offline")
    args = bench_offline.parse_args(["--model", tiny_llama_dir, "--methods", "plain", "ngram8", "lookahead"])
    bench_offline.check_args(bench_offline.build_parser(), args)
    one = bench_offline.engine_bytes(args.model)
    assert one > bench_offline.ENGINE_RUNTIME_BYTES  # weights and KV cache counted
    bench_offline.check_memory(args, available=3 * one)  # fits: no error
    with pytest.raises(SystemExit, match=r"3 engines.*fewer methods per process"):
        bench_offline.check_memory(args, available=3 * one - 1)
    args.skip_memory_check = True
    bench_offline.check_memory(args, available=0)


def test_jacobi_scaling_caps_g_to_fit_the_step_slots():
    scaling = _import_bench("bench_jacobi_scaling")
    # (W + G)(N - 1) - 1 <= 128: N=7, W=16 fits G=5 (125 slots), not G=6 (131).
    assert scaling.guesses_that_fit(7, 16, 128) == 5
    assert scaling.step_slots(7, 16, 5) == 125 and scaling.step_slots(7, 16, 6) == 131
    assert scaling.guesses_that_fit(3, 4, 128) == 4
    cells, skipped = scaling.grid([3, 9], [4, 16], 128)
    # N=9, W=16: even G=1 needs (17)(8) - 1 = 135 slots.
    assert cells == [(3, 4, 4), (3, 16, 16), (9, 4, 4)]
    assert [(s["ngram"], s["window"]) for s in skipped] == [(9, 16)]
    # The trie reference verifies the same G(N - 1) budget, without a window.
    assert scaling.trie_config(scaling.window_config("both", 5, 8, 8)["decoding_length"]) == {
        "source": "trie", "draft_shape": "hier", "decoding_length": 32, "cost_free_tokens": 0}
    assert scaling.window_config("both", 5, 8, 3)["decoding_length"] == 12


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts 0: must be at least 1"),
    (["--ngram", "3", "1"], "--ngram 1: must be at least 2"),
    (["--window", "0"], "--window 0: must be at least 1"),
])
def test_jacobi_scaling_rejects_bad_arguments(argv, message, capsys):
    scaling = _import_bench("bench_jacobi_scaling")
    with pytest.raises(SystemExit) as exc:
        scaling.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow  # 24 s: a lab benchmark's engines (kept out of the default suite's 20 minutes)
def test_jacobi_ceiling_compares_both_with_the_trie_at_the_same_budget(tiny_llama_dir, tmp_path):
    out = tmp_path / "ceiling.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_jacobi_scaling.py"), "--model", tiny_llama_dir,
           "--source", "both", "--dataset", "humaneval", "--num-prompts", "2", "--max-tokens", "16",
           "--ngram", "3", "--window", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows, tries = report["rows"], {r["decoding_length"]: r for r in report["trie_rows"]}
    assert [(r["source"], r["window"], r["guesses"]) for r in rows] == [("both", 2, 2)]
    assert list(tries) == [4] and tries[4]["source"] == "trie"
    for row in rows + list(tries.values()):
        assert row["mismatches"] == 0 and row["tokens"] == report["plain_steps"]
    for row in rows:
        trie = tries[row["decoding_length"]]
        assert row["trie_steps"] == trie["decoding_steps"]
        assert row["vs_trie"] == pytest.approx(trie["decoding_steps"] / row["decoding_steps"])
        # The window rode along on every step: (W + G)(N - 1) tokens scored.
        assert row["tokens_per_step_scored"] == (row["window"] + row["guesses"]) * 2
    assert out.with_suffix(".png").stat().st_size > 0


# ---------------------------------------------------------- vLLM baselines (suffix, ngram windows)
def _suffix_replay():
    pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference not installed (scripts/setup.sh)")
    return _import_bench("suffix_replay")


def test_suffix_replay_counts_every_step_and_mal_is_at_least_one():
    replay = _suffix_replay()
    prompts = [[(7 * i + j) % 50 for j in range(40)] for i in range(3)]
    outputs = [[(11 * i + 3 * j) % 50 for j in range(30)] for i in range(3)]
    r = replay.replay_suffix(prompts, outputs)
    assert r["tokens"] == sum(len(o) - 1 for o in outputs)  # the prefill's token is not a step's
    assert r["steps"] == len(r["draft_lengths"]) == len(r["accepted"])
    assert r["mal"] == pytest.approx(r["tokens"] / r["steps"]) and r["mal"] >= 1
    assert r["mean_acceptance_length"] >= 1
    assert r["draft_tokens"] == sum(r["draft_lengths"]) and r["accepted_tokens"] == sum(r["accepted"])
    assert all(0 <= a <= d for a, d in zip(r["accepted"], r["draft_lengths"]))


def test_suffix_replay_drafts_a_repeated_prompt_whole_and_is_deterministic():
    replay = _suffix_replay()
    prompt = list(range(100, 180))
    r = replay.replay_suffix([prompt], [prompt[:60]])
    # Each match lengthens the next draft (max_spec_factor 1) until match + draft
    # fill the tree depth (24: 12 + 12); every draft is accepted whole.
    assert max(r["accepted"]) == 12 and r["mal"] > 5
    assert r["accepted"] == r["draft_lengths"][:-1] + r["accepted"][-1:]
    again = replay.replay_suffix([prompt], [prompt[:60]])
    drop = ("drafter_ms_per_call",)
    assert {k: v for k, v in r.items() if k not in drop} == {k: v for k, v in again.items() if k not in drop}
    # A shallower tree caps every draft at its depth.
    assert max(replay.replay_suffix([prompt], [prompt[:60]], max_tree_depth=8)["draft_lengths"]) <= 8


def test_suffix_replay_later_requests_draft_from_earlier_responses():
    """vLLM's global tree: a finished request's response is drafted for later
    requests; requests of one wave step together, so none is ahead of another."""
    replay = _suffix_replay()
    answer = [(13 * j) % 97 + 200 for j in range(50)]  # in no prompt, no repeats
    prompts, outputs = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]], [answer] * 3
    alone = replay.replay_suffix(prompts[:1], outputs[:1])
    assert alone["steps"] == 49 and alone["accepted_tokens"] == 0
    both = replay.replay_suffix(prompts[:2], outputs[:2])
    assert both["steps"] - 49 < 10 and max(both["accepted"][49:]) == 12
    waved = replay.replay_suffix(prompts, outputs, batch=2)
    assert sum(waved["accepted"][:98]) == 0 and max(waved["accepted"][98:]) == 12
    assert waved["batch_steps"] == 49 + (waved["steps"] - 98)
    with pytest.raises(ValueError, match="batch=0"):
        replay.replay_suffix(prompts, outputs, batch=0)
    with pytest.raises(ValueError, match="min_token_prob=2"):
        replay.replay_suffix(prompts, outputs, min_token_prob=2)


def test_suffix_replay_models_speed_with_the_simulators_timing():
    """With a timing model, speed = plain forwards / the replay's forwards,
    each forward priced at 1 + the draft tokens of its rows."""
    replay = _suffix_replay()
    from lookahead_vllm.core.budget import ForwardCost

    prompt = list(range(100, 180))
    free = replay.replay_suffix([prompt], [prompt[:60]], timing=lambda tokens: 1.0)
    assert free["speed"] == pytest.approx(59 / free["steps"])  # every forward costs one plain forward
    cost = ForwardCost(2, 4.0)
    priced = replay.replay_suffix([prompt], [prompt[:60]], timing=cost)
    assert priced["speed"] == pytest.approx(59 / sum(cost(1 + d) for d in priced["draft_lengths"]))
    assert priced["speed"] < free["speed"]
    assert replay.replay_suffix([prompt], [prompt[:60]])["speed"] == 0.0  # no timing model, no speed


def test_gpu_prices_make_batch1_steps_free_in_the_replays():
    """Under the GPU token prices (64 tokens about free, tree paths free) a
    batch-1 step of at most 17 scored tokens costs one forward, so the
    modeled speedup equals tokens per step, for lookahead's replay (chains
    and trees) and the copy ceiling alike; the CPU prices charge for them."""
    sim, ceiling = _import_bench("sim_acceptance"), _import_bench("copy_ceiling")

    rng = np.random.default_rng(1)
    phrases = [list(rng.integers(0, 30, 5)) for _ in range(6)]
    prompts = [sum((phrases[j] for j in rng.integers(0, 6, 8)), []) for _ in range(4)]
    outputs = [sum((phrases[j] for j in rng.integers(0, 6, 6)), []) for _ in range(4)]
    for shape in ("one", "hier"):
        cfg = {"draft_shape": shape}
        gpu = sim.simulate(cfg, prompts, outputs, [], platform="gpu")
        assert gpu["speed"] == pytest.approx(gpu["mal"])
        cpu = sim.simulate(cfg, prompts, outputs, [], platform="cpu")
        assert cpu["speed"] < cpu["mal"]
    top = ceiling.ceiling(prompts, outputs, 16, sim.batch1_cost(resolve(platform="gpu")))
    assert top["speed"] == pytest.approx(top["mal"]) and top["mal"] > 1


def test_copy_ceiling_worked_example_and_bounds_the_drafters():
    ceiling = _import_bench("copy_ceiling")
    from lookahead_vllm.core.budget import ForwardCost

    # The module docstring's rule: prompt 1 2 3 4, output 1 2 3 4 5. After the
    # prefill's 1 the last token 1 was followed by 2 3 4 (then its period
    # repeats: 1), so 2 3 4 are accepted and 5 is the bonus: 1 step, MAL 4.
    r = ceiling.ceiling([[1, 2, 3, 4]], [[1, 2, 3, 4, 5]], 16, ForwardCost(2, 4.0))
    assert (r["steps"], r["tokens"], r["accepted_tokens"]) == (1, 4, 3)
    assert r["speed"] == pytest.approx(4 / ForwardCost(2, 4.0)(4))
    # k caps the copy; an output seen before is copied from the corpus.
    assert ceiling.ceiling([[1, 2, 3, 4]], [[1, 2, 3, 4, 5]], 1, lambda t: 1.0)["steps"] == 2
    answer = [(13 * j) % 97 + 200 for j in range(40)]
    two = ceiling.ceiling([[1], [2]], [answer, answer], 16, lambda t: 1.0)
    assert two["steps"] == 39 + 3  # the second copies the first's 39 tokens in 16 + 16 + 7
    # No drafter that copies earlier text accepts more (synthetic text with repeats).
    rng = np.random.default_rng(0)
    phrases = [list(rng.integers(0, 40, 6)) for _ in range(8)]
    prompts = [sum((phrases[j] for j in rng.integers(0, 8, 10)), []) for _ in range(6)]
    outputs = [sum((phrases[j] for j in rng.integers(0, 8, 8)), []) for _ in range(6)]
    top = ceiling.ceiling(prompts, outputs, 16, lambda t: 1.0)
    sim = _import_bench("sim_acceptance")
    for cfg in ({}, {"cost_free_tokens": 0}):
        ours = sim.simulate(cfg, prompts, outputs, [])
        assert ours["steps"] >= top["steps"] and ours["mal"] <= top["mal"] + 1e-9
    with pytest.raises(ValueError, match="k=0"):
        ceiling.ceiling(prompts, outputs, 0, lambda t: 1.0)


def test_predraft_outlook_counts_the_steps_a_predraft_would_serve(tmp_path):
    """A copy of the prompt: the one step that accepts its whole draft has the
    prompt's next token as its bonus, which the index expects (a hit). New
    tokens: every draft is empty and accepted whole, but the index expects
    nothing (no hit). Trees are not measured. The script writes JSON + PNG."""
    sim, outlook = _import_bench("sim_acceptance"), _import_bench("predraft_outlook")

    prompt = list(range(100, 140))
    k16 = {"decoding_length": 16}  # the CPU's default; the GPU's is 8
    copy = sim.simulate(k16, [prompt], [prompt[:30]], [], platform="gpu")
    # Prefill emits 100. The 1-token match drafts 101..105 (the floor cuts it), all accepted, bonus 106
    # (hit); the 7-token match drafts 107..122, bonus 123 (hit); then 124..129 of a 16-token draft.
    assert (copy["steps"], copy["whole_draft_steps"], copy["predraft_hit_steps"]) == (3, 2, 2)
    fresh = sim.simulate(k16, [prompt], [list(range(500, 530))], [], platform="gpu")
    assert fresh["whole_draft_steps"] == fresh["steps"] == 29 and fresh["predraft_hit_steps"] == 0
    assert outlook.outlook(copy) == {"whole": 2 / 3, "hit": 2 / 3}
    tree = sim.simulate({"draft_shape": "hier"}, [prompt], [prompt[:30]], [])
    assert tree["whole_draft_steps"] is None and tree["predraft_hit_steps"] is None
    model = tmp_path / "m"
    (tmp_path / "humaneval_dev_1_30_m.json").write_text(json.dumps({"prompts": [prompt], "outputs": [prompt[:30]]}))
    out = tmp_path / "outlook.json"
    rows = outlook.main(["--datasets", "humaneval", "--num-prompts", "1", "--max-tokens", "30", "--model", str(model),
                         "--cache", str(tmp_path), "--platforms", "gpu", "--batch", "1", "--out", str(out)])
    gpu_default = outlook.outlook(sim.simulate({}, [prompt], [prompt[:30]], [], platform="gpu"))  # k 8 there
    assert [(r["platform"], r["batch"], r["hit"]) for r in rows] == [("gpu", 1, gpu_default["hit"])]
    assert json.loads(out.read_text())["rows"] == rows and out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch 0: must be >= 1"),
    (["--depth", "8", "0"], "--depth 0: must be >= 1"),
    (["--min-token-prob", "1.5"], "--min-token-prob 1.5: must be in [0, 1]"),
])
def test_suffix_replay_rejects_bad_arguments(argv, message, capsys):
    replay = _import_bench("suffix_replay")
    with pytest.raises(SystemExit):
        replay.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.vllm
def test_suffix_replay_defaults_are_the_installed_vllm_defaults():
    from vllm.config import SpeculativeConfig

    replay = _import_bench("suffix_replay")
    fields = SpeculativeConfig.__dataclass_fields__
    assert fields["suffix_decoding_max_tree_depth"].default == replay.MAX_TREE_DEPTH
    assert fields["suffix_decoding_max_spec_factor"].default == replay.MAX_SPEC_FACTOR
    assert fields["suffix_decoding_min_token_prob"].default == replay.MIN_TOKEN_PROB
    assert fields["suffix_decoding_max_cached_requests"].default == replay.MAX_CACHED_REQUESTS


def test_benchmarks_name_the_vllm_baselines():
    baselines = _import_bench("baselines")
    bench_offline = _import_bench("bench_offline")
    config = baselines.baseline_config
    assert config("ngram8") == {"method": "ngram", "num_speculative_tokens": 8}
    assert config("ngram16-w2-4") == {"method": "ngram", "num_speculative_tokens": 16,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert config("ngram_gpu8-w2-4") == {"method": "ngram_gpu", "num_speculative_tokens": 8,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert config("ngram_gpu4") == {"method": "ngram_gpu", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="1 <= min <= max"):
        config("ngram_gpu8-w4-2")
    from lookahead_lab.offline import engine_kwargs  # the engine bench_offline builds before the config

    assert engine_kwargs("ngram_gpu", k=8)["speculative_config"] == {"method": "ngram_gpu", "num_speculative_tokens": 8}
    assert config("suffix") == {"method": "suffix"}  # vLLM's defaults, k = tree depth
    assert config("suffix-d32") == {"method": "suffix", "suffix_decoding_max_tree_depth": 32}
    assert config("plain") is None and config("lookahead") is None and config("ngram") is None
    assert bench_offline.is_per_cell("suffix-d16") and not bench_offline.is_per_cell("ngram8-w2-4")
    assert set(baselines.BASELINES) >= {"ngram4", "ngram8-w2-4", "ngram16-w2-4", "suffix", "suffix-d64"}


@pytest.mark.parametrize("argv, message", [
    (["--methods", "plain", "ngram8-w4-2"], "--methods 'ngram8-w4-2': needs k >= 1 and 1 <= min <= max"),
    (["--methods", "plain", "suffix-x"], "--methods 'suffix-x': expected plain"),
    (["--split", "train"], "--split 'train': expected one of test, dev"),
    (["--datasets", "nosuch"], "--datasets 'nosuch': expected one of"),
    (["--tenants", "-1"], "--tenants -1: must be 0 (no cache_salt) or 1..20 (--num-prompts)"),
    (["--num-prompts", "4", "--tenants", "0", "5"], "--tenants 5: must be 0 (no cache_salt) or 1..4 (--num-prompts)"),
    (["--tenants", "0", "4", "4"], "--tenants 0 4 4: has duplicates"),
    (["--tenants", "two"], "argument --tenants: invalid int value: 'two'"),
])
def test_bench_offline_rejects_bad_methods_and_splits(argv, message, capsys):
    bench_offline = _import_bench("bench_offline")
    with pytest.raises(SystemExit):
        bench_offline.parse_args(argv)
    assert message in capsys.readouterr().err


class _FakeLLM:
    """An engine stand-in for bench_offline's cells: records the prompts of
    every ``generate`` call and answers each with three tokens (two accepted
    of four drafted in one step when ``speculative``)."""

    def __init__(self, speculative: bool) -> None:
        self.speculative = speculative
        self.calls: list[list] = []

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        self.calls.append(list(prompts))
        metrics = SimpleNamespace(histogram=[0, 0, 1], num_draft_tokens=4) if self.speculative else None
        completion = SimpleNamespace(token_ids=[1, 2, 3], text="abc", spec_decode_metrics=metrics)
        return [SimpleNamespace(outputs=[completion]) for _ in prompts]


def _fake_cell(bench_offline, monkeypatch, tenants: list[int], bs: int):
    monkeypatch.setattr(bench_offline, "proposers", lambda llm: [])  # no lookahead drafter to inspect
    args = bench_offline.parse_args(["--methods", "plain", "ngram8", "--num-prompts", "5",
                                     "--tenants", *map(str, tenants), "--batch-sizes", str(bs)])
    engines = {"plain": _FakeLLM(speculative=False), "ngram8": _FakeLLM(speculative=True)}
    prompts = [f"prompt {i}" for i in range(5)]
    cells = [bench_offline.bench_cell("agent", bs, prompts, [], engines, args, params=None, tenants=n)
             for n in args.tenants]
    return args, engines, cells


def test_bench_offline_salts_prompt_i_with_tenant_i_mod_n_for_every_method(monkeypatch):
    bench_offline = _import_bench("bench_offline")
    assert bench_offline.tenant_prompts(["a", "b"], 0) == ["a", "b"]  # 0: bare texts, no salt
    _, engines, cells = _fake_cell(bench_offline, monkeypatch, tenants=[0, 2, 5], bs=2)
    assert [cell["tenants"] for cell in cells] == [0, 2, 5]
    for engine in engines.values():
        # Chunks of two in prompt order, one cell after another; both methods got the same prompts.
        sent = [p for call in engine.calls for p in call]
        assert [len(call) for call in engine.calls] == [2, 2, 1] * 3
        assert sent[:5] == [f"prompt {i}" for i in range(5)]
        assert sent[5:10] == [{"prompt": f"prompt {i}", "cache_salt": f"tenant-{i % 2}"} for i in range(5)]
        assert sent[10:] == [{"prompt": f"prompt {i}", "cache_salt": f"tenant-{i}"} for i in range(5)]
    assert engines["plain"].calls == engines["ngram8"].calls


def test_bench_offline_cells_per_tenant_count_and_acceptance_in_the_json(monkeypatch, tmp_path):
    bench_offline = _import_bench("bench_offline")
    args = bench_offline.parse_args(["--datasets", "agent", "humaneval", "--tenants", "0", "7",
                                     "--batch-sizes", "1", "8", "--num-prompts", "8"])
    assert bench_offline.cell_keys(args) == [
        ("agent", 0, 1), ("agent", 0, 8), ("agent", 7, 1), ("agent", 7, 8),
        ("humaneval", 0, 1), ("humaneval", 0, 8), ("humaneval", 7, 1), ("humaneval", 7, 8)]
    assert bench_offline.parse_args([]).tenants == [0]  # default: no salt, as before
    args, _, cells = _fake_cell(bench_offline, monkeypatch, tenants=[0, 3], bs=8)
    args.model, args.out, args.plot, args.copy_latest = tmp_path, tmp_path / "b.json", tmp_path / "b.png", False
    for name, value in {"machine_info": {}, "versions": {}, "git_info": {}, "other_load": 0.0}.items():
        monkeypatch.setattr(bench_offline, name, lambda *a, value=value: value)
    bench_offline.write_outputs({**bench_offline.context(args), "cells": cells}, args)
    report = json.loads(args.out.read_text())
    assert report["args"]["tenants"] == [0, 3]
    assert [cell["tenants"] for cell in report["cells"]] == [0, 3]
    for cell in report["cells"]:
        rows = {row["method"]: row for row in cell["methods"]}
        # One drafting step per prompt, two of its four draft tokens accepted.
        assert rows["ngram8"]["num_drafts"] == 5 and rows["ngram8"]["num_accepted"] == 10
        assert rows["ngram8"]["num_draft_tokens"] == 20
        assert rows["ngram8"]["mean_acceptance_length"] == 3.0
        assert rows["ngram8"]["draft_acceptance_rate"] == 0.5
        assert rows["plain"]["mean_acceptance_length"] is None and rows["plain"]["num_drafts"] == 0
    assert args.plot.stat().st_size > 0
    table = bench_offline.format_table(report)
    assert table.splitlines()[0].split()[:4] == ["dataset", "tenants", "bs", "method"]
    unsalted = {**report, "cells": [cell for cell in report["cells"] if cell["tenants"] == 0]}
    assert bench_offline.format_table(unsalted).splitlines()[0].split()[:3] == ["dataset", "bs", "method"]


def test_bench_offline_tenant_counts_of_the_readme_split_the_agent_class_as_documented(monkeypatch):
    """benchmarks/README.md's tenant command: with 7 tenants each tenant sends one
    agent task kind, with 4 each sends every kind; it parses."""
    import shlex

    from lookahead_lab.datasets import split_prompts

    bench_offline = _import_bench("bench_offline")
    monkeypatch.setattr(bench_offline, "has_suffix_decoding", lambda: True)  # parses without arctic too
    readme = (REPO / "benchmarks" / "README.md").read_text()
    line = next(ln for ln in readme.replace("\\\n", " ").splitlines() if "--tenants 0 1 4 7 28" in ln)
    args = bench_offline.parse_args(shlex.split(line)[2:])
    kinds = [p.key.split("/")[1] for p in split_prompts("agent", args.split, args.num_prompts)]
    assert len(kinds) == args.num_prompts == 28
    by_tenant = {n: [{k for i, k in enumerate(kinds) if i % n == t} for t in range(n)] for n in (4, 7)}
    assert all(len(k) == 1 for k in by_tenant[7]) and len(set().union(*by_tenant[7])) == 7
    assert all(len(k) == 7 for k in by_tenant[4])


@pytest.mark.vllm
@pytest.mark.slow  # 22 s: bench_offline's own run above covers its vLLM baselines with the plugin
def test_bench_offline_runs_vllm_baselines_without_arctic_plugin(tiny_llama_dir, tmp_path):
    """suffix runs from arctic_inference.suffix_decoding alone: the harness's
    engines load no plugin but ours (VLLM_PLUGINS from CPU_ENV)."""
    pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference not installed (scripts/setup.sh)")
    out = tmp_path / "bench.json"
    env = {k: v for k, v in __import__("os").environ.items() if k != "VLLM_PLUGINS"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_offline.py"), "--model", tiny_llama_dir,
           "--datasets", "humaneval", "--num-prompts", "2", "--max-tokens", "8", "--batch-sizes", "2",
           "--methods", "plain", "ngram4-w2-4", "suffix-d8", "--out", str(out), "--plot", str(tmp_path / "b.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    from importlib.metadata import entry_points

    # arctic registers a general plugin, so only the filter keeps it out.
    assert "arctic_inference" in {ep.name for ep in entry_points(group="vllm.general_plugins")}
    assert report["vllm_plugins_loaded"] == ["lookahead"]
    assert "Arctic Inference plugin" not in proc.stderr
    rows = {row["method"]: row for row in report["cells"][0]["methods"]}
    assert list(rows) == ["plain", "ngram4-w2-4", "suffix-d8"]
    for method in ("ngram4-w2-4", "suffix-d8"):
        assert rows[method]["mismatches"] == 0 and rows[method]["drafter_ms_per_step"] is not None
    assert all(row["sample_ms_per_step"] > 0 for row in rows.values())  # the runner's _sample, timed
    plain_steps = rows["plain"]["step_periods"]  # the cell's step clock: plain never drafts
    assert plain_steps["decode_draftless"]["steps"] > 0 and plain_steps["decode_drafted"]["steps"] == 0


def test_sim_acceptance_index_drafts_a_repeated_answer_across_rounds():
    sim_acceptance = _import_bench("sim_acceptance")

    prompts = [[7, 8, 9, i] for i in range(4)]
    outputs = [list(range(100 * (i + 1), 100 * (i + 1) + 60)) for i in range(4)]
    cfg = {"cost_free_tokens": 0}
    once = sim_acceptance.simulate(cfg, prompts, outputs, [])
    twice = sim_acceptance.simulate(cfg, prompts * 2, outputs * 2, [])
    # Nothing repeats within a round; the second round copies the first's answers.
    assert once["mal"] < 1.5 and twice["mal"] > 1.6
    assert twice["acceptance_per_drafted_token"] > 0.5


@pytest.mark.vllm
def test_bench_proposer_scale_reports_every_cell(tmp_path):
    bench = _import_bench("bench_proposer_scale")
    out = tmp_path / "scale.json"
    report = bench.main(["--batch", "4", "--prompt-tokens", "64", "--steps", "6", "--upkeep", "inline",
                         "--out", str(out)])
    cells = report["cells"]
    assert [c["source"] for c in cells] == ["index", "index+trie"]
    assert all(c["step_ms_median"] > 0 and c["step_ms_max"] >= c["step_ms_median"] for c in cells)
    # Drafts are verified against the text: some get accepted.
    assert cells[0]["accepted_per_request_step"] > 0 and cells[1]["accepted_per_request_step"] > 0
    assert cells[0]["drafter_bytes"] > 0 and out.exists() and out.with_suffix(".png").exists()
    # With the caches flushed before each step, upkeep inline and on its
    # thread: the same drafts, still timed.
    cold = bench.main(["--batch", "4", "--prompt-tokens", "64", "--steps", "6", "--sources", "index",
                       "--flush-mib", "1", "--out", str(tmp_path / "cold.json")])["cells"]
    assert [c["upkeep"] for c in cold] == ["inline", "thread"]
    for cell in cold:
        assert cell["flush_mib"] == 1 and cell["step_ms_median"] > 0
        assert cell["accepted_per_request_step"] == cells[0]["accepted_per_request_step"]
        assert cell["draft_tokens_per_step"] == cells[0]["draft_tokens_per_step"]


@pytest.mark.vllm
def test_bench_proposer_scale_drafts_trees(tmp_path):
    """``--draft-shape hier``: every request may verify a tree; the index
    alone and the index with the trie both hand trees out."""
    bench = _import_bench("bench_proposer_scale")
    cells = bench.main(["--batch", "4", "--prompt-tokens", "64", "--steps", "6", "--upkeep", "inline",
                        "--sources", "index", "index+trie", "--draft-shape", "hier",
                        "--out", str(tmp_path / "trees.json")])["cells"]
    assert [c["draft_shape"] for c in cells] == ["hier", "hier"]
    for cell in cells:
        assert cell["accepted_per_request_step"] > 0 and cell["draft_tokens_per_step"] > 0
    # --index-threads: a cell per count (at least 32 rows a thread, so 64 rows to use two), the same drafts
    threaded = bench.main(["--batch", "64", "--prompt-tokens", "64", "--steps", "4", "--upkeep", "inline",
                           "--sources", "index", "--draft-shape", "hier", "--index-threads", "1", "2",
                           "--out", str(tmp_path / "threads.json")])["cells"]
    assert [c["index_threads"] for c in threaded] == [1, 2]
    assert threaded[0]["draft_tokens_per_step"] == threaded[1]["draft_tokens_per_step"] > 0
    assert threaded[0]["accepted_per_request_step"] == threaded[1]["accepted_per_request_step"]


@pytest.mark.vllm
def test_bench_proposer_scale_times_the_steps_phases(tmp_path):
    """``--phases``: each cell reports the median ms per call of the phases its source runs (the
    Jacobi ones only with ``jacobi``), the drafts stay what they are without timers, and the
    proposer module's ``plan_trees`` is itself again afterwards."""
    import lookahead_vllm.vllm.proposer as module

    bench = _import_bench("bench_proposer_scale")
    plan_trees = module.plan_trees
    argv = ["--batch", "4", "--prompt-tokens", "64", "--steps", "6", "--upkeep", "inline", "--sources", "index",
            "index+jacobi", "--draft-shape", "hier"]
    timed = bench.main([*argv, "--phases", "--out", str(tmp_path / "phases.json")])["cells"]
    plain = bench.main([*argv, "--out", str(tmp_path / "plain.json")])["cells"]
    assert module.plan_trees is plan_trees
    index, jacobi = (c["phase_ms_median"] for c in timed)
    assert set(index) == {"book", "sync", "draft", "plan"} and min(index.values()) > 0
    assert {"merge", "pool", "windows", "track"} <= set(jacobi)
    assert jacobi["merge"] >= jacobi["draft"]  # the merged sources' call drafts the index's rows inside it
    assert "phase_ms_median" not in plain[0]
    assert [c["draft_tokens_per_step"] for c in timed] == [c["draft_tokens_per_step"] for c in plain]


def test_bench_proposer_scale_repeats_report_medians_and_the_largest_max():
    bench = _import_bench("bench_proposer_scale")
    figures = iter([(1.0, 2.0, 9.0), (3.0, 4.0, 5.0), (2.0, 3.0, 4.0)])

    def run():
        median, p99, most = next(figures)
        return {"source": "index", "step_ms_median": median, "step_ms_p99": p99, "step_ms_max": most,
                "admit_ms_one_more_prompt": median / 10, "admit_ms_per_prompt_batch_start": 0.5,
                "admit_ms_one_more_prompt_max": most / 10, "max_rss_mib": median * 100}

    cell = bench.repeated(run, 3)
    assert (cell["step_ms_median"], cell["step_ms_p99"], cell["step_ms_max"]) == (2.0, 3.0, 9.0)
    assert cell["admit_ms_one_more_prompt"] == pytest.approx(0.2) and cell["max_rss_mib"] == 300.0
    assert cell["repeats"] == 3 and [r["step_ms_median"] for r in cell["runs"]] == [1.0, 3.0, 2.0]


@pytest.mark.parametrize("argv,message", [(["--batch", "0"], "--batch 0: must be >= 1"),
                                          (["--steps", "0"], "--steps 0: must be >= 1"),
                                          (["--repeats", "0"], "--repeats 0: must be >= 1"),
                                          (["--flush-mib", "-1"], "--flush-mib -1: must be >= 0"),
                                          (["--index-threads", "300"], "--index-threads 300: must be in [0, 256]"),
                                          (["--upkeep", "later"], "--upkeep: invalid choice: 'later'"),
                                          (["--draft-shape", "tree"], "--draft-shape: invalid choice: 'tree'"),
                                          (["--sources", "index:fast"], "--sources 'index:fast': must be one of")])
def test_bench_proposer_scale_rejects_bad_arguments(argv, message, capsys):
    bench = _import_bench("bench_proposer_scale")
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_bench_cpu_preload_pairs_runs_and_reports_ratios(tmp_path):
    bench = _import_bench("bench_cpu_preload")

    def report(tok_s: dict) -> Path:
        path = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"cells": [{"dataset": "chat", "batch_size": 8, "methods": [
            {"method": m, "tok_s": v} for m, v in tok_s.items()]}]}))
        return path

    runs = [report({"plain": 10.0, "lookahead": 20.0}), report({"plain": 12.0, "lookahead": 20.0}),
            report({"plain": 10.0, "lookahead": 20.0}), report({"plain": 12.0, "lookahead": 30.0})]
    out = tmp_path / "preload.json"
    result = bench.main(["--from-runs", *map(str, runs), "--out", str(out)])
    ratios = {r["method"]: r["on_over_off"] for r in result["rows"]}
    assert ratios == {"plain": pytest.approx(1.2), "lookahead": pytest.approx(1.25)}
    assert result["median_on_over_off"] == pytest.approx(1.225) and out.with_suffix(".png").exists()
    with pytest.raises(SystemExit):
        bench.main(["--from-runs", str(runs[0]), "--out", str(out)])


def test_bench_corpus_cap_keeps_the_charge_under_the_cap_while_outputs_stream_through(tmp_path, capsys):
    """1 MiB cap, 300 finished 256-token outputs: evictions start, the charge
    ends every report within the cap, and the held tokens stop growing."""
    bench = _import_bench("bench_corpus_cap")
    out = tmp_path / "cap.json"
    report = bench.main(["--cap-mib", "1", "--requests", "300", "--batch", "8", "--prompt-tokens", "64",
                         "--output-tokens", "256", "--report-every", "50", "--upkeep", "inline", "--out", str(out)])
    rows = report["rows"]
    assert not report["over_cap"] and len(rows) == 6 and out.with_suffix(".png").exists()
    assert all(r["corpus_charge_bytes"] <= 1 << 20 for r in rows)
    assert max(r["corpus_charge_bytes"] for r in rows) > 0.9 * (1 << 20)  # the cap was reached
    held = [sum(r["corpus_tokens"]) for r in rows]
    assert held[-1] < 300 * 256 and held[-1] <= 1.1 * held[2], held  # outputs were evicted
    assert json.loads(out.read_text())["steps"] == report["steps"]


@pytest.mark.parametrize("argv,message", [(["--cap-mib", "0"], "--cap-mib 0: must be >= 1"),
                                          (["--tokens-per-step", "0"], "--tokens-per-step 0: must be >= 1"),
                                          (["--upkeep", "later"], "--upkeep: invalid choice: 'later'")])
def test_bench_corpus_cap_rejects_bad_arguments(argv, message, capsys):
    bench = _import_bench("bench_corpus_cap")
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ bench_serve
def test_bench_serve_names_every_method_with_its_server_flags():
    bench_serve = _import_bench("bench_serve")
    flags = bench_serve.method_flags
    assert flags("plain") == [] and flags("lookahead") == ["--speculative-model", "lookahead"]
    assert flags("plain-sync") == ["--no-async-scheduling"]
    assert flags("ngram8-w2-4") == ["--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4})]
    assert flags("suffix-d32") == ["--speculative-config",
                                   json.dumps({"method": "suffix", "suffix_decoding_max_tree_depth": 32})]
    with pytest.raises(ValueError, match="expected plain, plain-sync, lookahead"):
        flags("ngram")
    assert flags("lookahead:free16", {"free16": {"cost_free_tokens": 16}}) == [
        "--speculative-model", "lookahead", "--additional-config", '{"lookahead": {"cost_free_tokens": 16}}']
    with pytest.raises(ValueError, match="no --variant free16=JSON"):
        flags("lookahead:free16", {})
    # --lookahead-config: plain lookahead's fields, under the name ""
    assert flags("lookahead", {"": {"_profile": {"index_ngram": 3}}}) == [
        "--speculative-model", "lookahead", "--additional-config", '{"lookahead": {"_profile": {"index_ngram": 3}}}']


def test_bench_serve_counts_acceptance_from_the_servers_counters():
    bench_serve = _import_bench("bench_serve")
    metrics = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 64.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 24.0',
        # the per-position counter shares the prefix and must not be summed in
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
    ])
    counters = bench_serve.parse_counters(metrics, bench_serve.SPEC_COUNTERS)
    assert counters == {"vllm:spec_decode_num_drafts": 16.0, "vllm:spec_decode_num_draft_tokens": 64.0,
                        "vllm:spec_decode_num_accepted_tokens": 24.0}
    stats = bench_serve.acceptance(counters)
    assert stats["mean_acceptance_length"] == pytest.approx(1 + 24 / 16)
    assert stats["acceptance_rate"] == pytest.approx(24 / 64)
    # plain vLLM exports none of them: nothing drafted, no acceptance figures
    assert bench_serve.acceptance(bench_serve.parse_counters("# nothing\n", bench_serve.SPEC_COUNTERS)) == {
        "drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0,
        "mean_acceptance_length": None, "acceptance_rate": None}


@pytest.mark.parametrize("argv, message", [
    (["--methods", "lookahead"], "--methods must include plain"),
    (["--methods", "plain", "ngram"], "--methods 'ngram': expected plain, plain-sync, lookahead"),
    (["--methods", "plain", "ngram8-w4-2"], "--methods 'ngram8-w4-2': needs k >= 1 and 1 <= min <= max"),
    (["--methods", "plain", "plain"], "each method once"),
    (["--datasets", "nosuch"], "invalid choice: 'nosuch'"),
    (["--split", "train"], "invalid choice: 'train'"),
    (["--concurrency", "1", "0"], "--concurrency [1, 0]: every value must be >= 1"),
    (["--concurrency", "1", "8", "--num-prompts", "1", "2", "3"], "one value, or one per --concurrency (2)"),
    (["--max-tokens", "0"], "--max-tokens 0: must be >= 1"),
    (["--lookahead-config", "{oops"], "--lookahead-config: not JSON"),
    (["--lookahead-config", "[1]"], "--lookahead-config '[1]': expected a JSON object"),
    (["--methods", "plain", "lookahead:x"], "--methods 'lookahead:x': no --variant x=JSON given"),
    (["--variant", "x={oops"], "--variant 'x={oops': not JSON"),
    (["--variant", "x=[1]"], "--variant 'x=[1]': expected NAME=JSON object"),
    (["--waves", "0"], "--waves 0: must be >= 1"),
    (["--waves", "2", "--depth", "0"], "--depth 0: must be >= 1"),
    (["--temperature", "2.5"], "--temperature 2.5: must be in [0, 2]"),
    (["--temperature", "-0.1"], "--temperature -0.1: must be in [0, 2]"),
    (["--temperature", "0.8", "--sampled-share", "0"], "--sampled-share 0.0: must be in (0, 1]"),
    (["--temperature", "0.8", "--sampled-share", "1.5"], "--sampled-share 1.5: must be in (0, 1]"),
    (["--sampled-share", "0.5"], "--sampled-share 0.5: needs --temperature > 0"),
])
def test_bench_serve_rejects_bad_arguments(argv, message, capsys):
    bench_serve = _import_bench("bench_serve")
    with pytest.raises(SystemExit):
        bench_serve.parse_args([*argv, "--methods", "plain"] if argv[0] != "--methods" else argv)
    assert message in capsys.readouterr().err


def _word_tokenizer():
    """A whitespace word-level tokenizer (every word unknown) with a plain chat template:
    prompts' lengths in words, no model needed."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tokenizer


def test_bench_serve_takes_each_class_split_and_checks_it_fits():
    from lookahead_lab.datasets import load_split

    bench_serve = _import_bench("bench_serve")
    tokenizer = _word_tokenizer()
    args = bench_serve.parse_args(["--methods", "plain", "lookahead", "--datasets", "codeedit", "agent",
                                   "--split", "dev", "--concurrency", "1", "4", "--num-prompts", "2", "5"])
    prompts = bench_serve.workload_prompts(args, tokenizer)
    assert list(prompts) == ["codeedit", "agent"]
    assert prompts["agent"] == load_split("agent", "dev", tokenizer, 7)  # 2 for c=1, the next 5 for c=4
    assert prompts["codeedit"] != load_split("codeedit", "test", tokenizer, 5)
    with pytest.raises(SystemExit, match="holds"):
        bench_serve.workload_prompts(bench_serve.parse_args(["--methods", "plain", "--num-prompts", "100000"]),
                                     tokenizer)
    with pytest.raises(SystemExit, match="--max-model-len 64: docqa has a"):
        bench_serve.workload_prompts(bench_serve.parse_args(["--methods", "plain", "--datasets", "docqa",
                                                             "--max-model-len", "64", "--num-prompts", "1"]),
                                     tokenizer)


def test_bench_serve_ratio_interval_is_a_t_interval_on_log_ratios():
    import math
    import statistics

    bench_serve = _import_bench("bench_serve")
    assert bench_serve.ratio_interval([1.2]) == (pytest.approx(1.2), None, None)  # one wave: no interval
    ratios = [0.95, 1.05, 1.0, 0.98]
    mean, low, high = bench_serve.ratio_interval(ratios)
    logs = [math.log(r) for r in ratios]
    half = 3.182 * statistics.stdev(logs) / 2  # t(0.975, 3 df), sqrt(4 waves)
    assert mean == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (low, high) == (pytest.approx(mean * math.exp(-half)), pytest.approx(mean * math.exp(half)))
    assert low < 1.0 < high  # these waves cannot tell the method from plain
    _, low, high = bench_serve.ratio_interval([0.90, 0.91, 0.92, 0.90, 0.91, 0.90])
    assert high < 1.0  # a steady 9% loss is told from noise
    _, wide_low, wide_high = bench_serve.ratio_interval([0.8, 1.2, 0.8, 1.2])
    assert wide_low < 0.9 and wide_high > 1.1  # single waves swinging 20% make a wide interval


def test_bench_serve_compares_texts_only_when_greedy():
    """Greedy requests count when their text differs from plain's; sampled ones (--temperature > 0, texts
    differ by their draws) are not compared: a cell that only sampled has mismatches None, not 0, and a
    mixed one (--sampled-share) counts its greedy requests alone."""
    bench_serve = _import_bench("bench_serve")
    # lookahead differs from plain on prompt 1 and 2; prompt 2 sampled in the mixed cell
    for sampled, expected in ((frozenset(), 2), (frozenset({0, 1, 2}), None), (frozenset({2}), 1),
                              (frozenset({1, 2}), 0)):
        cell = bench_serve.Cell(sampled=sampled, wall_s=2.0)
        for name, texts in (("plain", ["a", "b", "d"]), ("lookahead", ["a", "c", "e"])):
            cell.latency[name], cell.ttft[name] = [1.0] * 3, [0.1] * 3
            cell.tokens[name], cell.seconds[name] = [8], [1.0]
            cell.texts[name] = dict(enumerate(texts))
        out = bench_serve.summarize(cell, 3, "mixed")
        assert out["methods"]["lookahead"]["mismatches"] == expected
        assert out["methods"]["plain"]["mismatches"] == (None if expected is None else 0)
    assert bench_serve.parse_args(["--methods", "plain"]).temperature == 0.0  # greedy unless asked


def test_bench_serve_sampled_share_spreads_sampling_evenly():
    bench_serve = _import_bench("bench_serve")
    assert bench_serve.sampling_temperatures(4, 0.8) == [0.8] * 4  # the default share: every request
    assert bench_serve.sampling_temperatures(6, 0.8, 0.5) == [0.0, 0.8] * 3
    temps = bench_serve.sampling_temperatures(100, 0.7, 0.25)
    assert temps.count(0.7) == 25 and temps.count(0.0) == 75
    assert all(temps[i:i + 4].count(0.7) == 1 for i in range(0, 100, 4))  # a wave of 4 holds one sampled request
    assert bench_serve.sampling_temperatures(3, 0.0, 1.0) == [0.0] * 3
    assert bench_serve.parse_args(["--temperature", "0.8", "--sampled-share", "0.5"]).sampled_share == 0.5


def test_bench_serve_tells_refills_in_lockstep_from_refills_apart():
    """Closed loop, c=2, waves of 5: the first 2 of a wave go out at its start, the rest as others finish."""
    together = _import_bench("bench_serve").refills_sent_together
    lockstep = [0.0, 0.0, 3.00, 3.02, 6.0] * 2  # the two first finish together: their refills go out together
    apart = [0.0, 0.0, 2.0, 3.5, 5.0] * 2
    assert together(lockstep, 2, 5) == pytest.approx((2 + 2 + 1) / 3)
    assert together(apart, 2, 5) == 1.0
    assert together([0.0, 0.0], 2, 2) is None  # no refills


def test_plot_load_curve_pools_each_concurrencys_waves_over_files(tmp_path):
    """The README's load curve: a concurrency's paired waves from several runs pooled into one interval."""
    import math

    plot_load_curve = _import_bench("plot_load_curve")

    def run(path, concurrency, waves):
        cell = {"concurrency": concurrency, "methods": {"plain": {"speedup_waves": [1.0] * len(waves)},
                                                        "lookahead": {"speedup_waves": waves}}}
        path.write_text(json.dumps({"cells": [cell]}))
        return path

    a, b = run(tmp_path / "a.json", 32, [0.9, 1.0]), run(tmp_path / "b.json", 32, [1.1, 1.0])
    curve = plot_load_curve.main([f"32={a}", f"32={b}", f"1={run(tmp_path / 'c.json', 1, [1.5])}",
                                  "--out", str(tmp_path / "curve.json")])
    pooled = curve[32]["lookahead"]
    assert pooled["waves"] == 4 and "plain" not in curve[32]
    assert pooled["speedup"] == pytest.approx(math.exp(sum(map(math.log, [0.9, 1.0, 1.1, 1.0])) / 4))
    assert pooled["ci95"][0] < 1.0 < pooled["ci95"][1]
    assert curve[1]["lookahead"]["ci95"] == [None, None]  # one wave: no interval
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert json.loads((tmp_path / "curve.json").read_text())["cells"]["32"]["lookahead"]["waves"] == 4
    with_variant = json.loads(a.read_text())
    with_variant["cells"][0]["methods"]["lookahead:dear"] = {"speedup_waves": [0.5, 0.5]}
    (tmp_path / "v.json").write_text(json.dumps(with_variant))
    curve = plot_load_curve.main([f"32={tmp_path / 'v.json'}", f"32={b}", "--out", str(tmp_path / "v_curve.json")])
    assert set(curve[32]) == {"lookahead"} and curve[32]["lookahead"]["waves"] == 4  # a variant is not a method
    curve = plot_load_curve.main([f"32={tmp_path / 'v.json'}@lookahead:dear,{b}", "--out", str(tmp_path / "w.json")])
    assert curve[32]["lookahead"]["speedup"] == pytest.approx(math.exp(sum(map(math.log, [0.5, 0.5, 1.1, 1.0])) / 4))
    curve = plot_load_curve.main([f"32={tmp_path / 'v.json'}@-", f"32={b}", "--out", str(tmp_path / "w.json")])
    assert curve[32]["lookahead"]["waves"] == 2 and curve[32]["lookahead"]["speedup"] == pytest.approx(1.1 ** 0.5)
    with pytest.raises(SystemExit, match="no row 'lookahead:gone'"):
        plot_load_curve.main([f"32={a}@lookahead:gone", "--out", str(tmp_path / "w.json")])
    with pytest.raises(SystemExit, match="no cells at concurrency 8"):
        plot_load_curve.main([f"8={a}", "--out", str(tmp_path / "x.json")])
    sustained = tmp_path / "d.json"
    sustained.write_text(json.dumps({"cells": [{**json.loads(a.read_text())["cells"][0], "depth": 4}]}))
    assert plot_load_curve.main([f"32={sustained}", "--out", str(tmp_path / "y.json")])[32]["lookahead"]["depth"] == 4
    with pytest.raises(SystemExit, match=r"\[\(1, None, None\), \(4, None, None\)\]"):  # bursts and sustained waves apart
        plot_load_curve.main([f"32={a},{sustained}", "--out", str(tmp_path / "z.json")])
    one = json.loads(run(tmp_path / "e.json", 1, [1.2]).read_text())["cells"][0]
    (tmp_path / "f.json").write_text(json.dumps({"cells": [{**one, "depth": 4}]}))
    c1 = plot_load_curve.main([f"1={tmp_path / 'e.json'},{tmp_path / 'f.json'}", "--out", str(tmp_path / "g.json")])
    assert c1[1]["lookahead"]["waves"] == 2  # at c=1 a burst and a sustained wave both keep one request out
    varied = tmp_path / "h.json"
    varied.write_text(json.dumps({"args": {"vary_lengths": 16}, "cells": json.loads(a.read_text())["cells"]}))
    with pytest.raises(SystemExit, match=r"\(1, 16, None\)"):  # one cap for every answer, or varied lengths: not both
        plot_load_curve.main([f"32={a},{varied}", "--out", str(tmp_path / "i.json")])


def test_plot_load_curve_tails_are_each_files_ratio_to_its_own_plain(tmp_path):
    plot_load_curve = _import_bench("plot_load_curve")
    files = []
    for i, (p99, ttft) in enumerate([(1.2, 0.5), (1.2 / 1.44, 2.0)]):
        row = {"speedup_waves": [1.0], "latency_p99_s": 10.0 * p99, "ttft_p50_s": ttft}
        cell = {"concurrency": 8, "methods": {"plain": {"speedup_waves": [1.0], "latency_p99_s": 10.0,
                                                        "ttft_p50_s": 1.0}, "lookahead": row}}
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps({"cells": [cell]}))
    curve = plot_load_curve.main([f"8={files[0]},{files[1]}", "--out", str(tmp_path / "t.json")])
    assert curve[8]["lookahead"]["p99_ratio"] == pytest.approx(1.0)  # sqrt(1.2 * 1.2 / 1.44)
    assert curve[8]["lookahead"]["ttft_p50_ratio"] == pytest.approx(1.0)  # sqrt(0.5 * 2.0)


def test_bench_serve_waves_and_the_mixed_class():
    from lookahead_lab.datasets import DATASETS, load_split

    bench_serve = _import_bench("bench_serve")
    tokenizer = _word_tokenizer()
    args = bench_serve.parse_args(["--methods", "plain", "--datasets", "mixed", "--concurrency", "1", "8", "32",
                                   "--waves", "4"])
    assert args.counts == [4, 32, 128]
    prompts = bench_serve.workload_prompts(args, tokenizer)["mixed"]
    assert len(prompts) == len(set(prompts)) == 164  # no prompt twice
    firsts = [load_split(d, "test", tokenizer, 2) for d in DATASETS]
    assert prompts[:len(DATASETS)] == [f[0] for f in firsts]  # one of each class, then the next of each
    assert prompts[len(DATASETS):2 * len(DATASETS)] == [f[1] for f in firsts]
    with pytest.raises(SystemExit, match="holds"):  # more waves than the six classes' prompts
        bench_serve.workload_prompts(bench_serve.parse_args(["--methods", "plain", "--datasets", "mixed",
                                                             "--concurrency", "64", "--waves", "8"]), tokenizer)


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_serve_runs_real_servers_and_reports_each_class(tiny_llama_dir, tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_serve.py"), "--model", tiny_llama_dir,
           "--methods", "plain", "lookahead", "--datasets", "agent", "mtbench", "--concurrency", "1", "2",
           "--num-prompts", "1", "2", "--max-tokens", "12", "--max-model-len", "2048", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(c["dataset"], c["concurrency"]) for c in report["cells"]] == [
        ("agent", 1), ("agent", 2), ("mtbench", 1), ("mtbench", 2)]
    for cell in report["cells"]:
        plain, lookahead = cell["methods"]["plain"], cell["methods"]["lookahead"]
        assert plain["requests"] == lookahead["requests"] == cell["concurrency"]
        assert lookahead["mismatches"] == 0
        assert plain["drafts"] == 0 and plain["mean_acceptance_length"] is None
        assert lookahead["accepted_tokens"] <= lookahead["draft_tokens"]
        assert len(lookahead["speedup_waves"]) == 1 and lookahead["speedup_ci95"] == [None, None]
    # the servers' counters were read: lookahead drafted somewhere in the run
    assert sum(c["methods"]["lookahead"]["drafts"] for c in report["cells"]) > 0
    assert out.with_suffix(".png").stat().st_size > 0


# ------------------------------------------------------------------ bench_soak
def test_bench_soak_splits_a_servers_memory_into_api_and_engine():
    bench_soak = _import_bench("bench_soak")
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while bench_soak.rss_parts(os.getpid())["engine"] < 64 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        parts = bench_soak.rss_parts(os.getpid())
        assert parts["engine"] >= 64 << 20  # the child's buffer, counted under the descendants
        assert parts["api"] > 0 and bench_soak.tree_rss_bytes(os.getpid()) >= parts["api"] + (64 << 20)
    finally:
        child.kill()
        child.wait()
    mib = 1 << 20
    report = bench_soak.rss_report({"api": 100 * mib, "engine": 300 * mib}, {"api": 100 * mib, "engine": 330 * mib},
                                   {"api": 120 * mib, "engine": 330 * mib})
    assert report["rss_before_mib"] == 400 and report["rss_after_mib"] == 450
    assert report["parts"]["engine"]["growth_first_half_pct"] == pytest.approx(10.0)
    assert report["parts"]["engine"]["growth_second_half_pct"] == 0
    assert report["parts"]["api"]["growth_second_half_pct"] == pytest.approx(20.0)


def test_bench_soak_charges_a_segments_cpu_to_the_server_that_served_it():
    bench_soak = _import_bench("bench_soak")
    # A busy child is counted in the engine part, not the API part.
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 1.0: pass\ntime.sleep(30)"])
    try:
        before = bench_soak.cpu_parts(os.getpid())
        deadline = time.monotonic() + 20
        while bench_soak.cpu_parts(os.getpid())["engine"] - before["engine"] < 0.9 and time.monotonic() < deadline:
            time.sleep(0.1)
        after = bench_soak.cpu_parts(os.getpid())
        assert after["engine"] - before["engine"] >= 0.9
        assert after["api"] - before["api"] < 0.9  # this process only waited
    finally:
        child.kill()
        child.wait()
    marks = [{"servers": {"plain": {"api": 1.0, "engine": 10.0}, "lookahead": {"api": 2.0, "engine": 20.0}},
              "client": 5.0, "busy": 100.0},
             {"servers": {"plain": {"api": 1.5, "engine": 10.5}, "lookahead": {"api": 4.0, "engine": 50.0}},
              "client": 7.0, "busy": 140.0}]
    got = bench_soak.segment_cpu(*marks, "lookahead")
    # the idle plain server's 1 s counts as "other" for a segment lookahead served
    assert got == pytest.approx({"api": 2.0, "engine": 30.0, "client": 2.0, "other": 5.0})
    ratios = bench_soak.paired_cpu_ratios([{**got, "other": 0.0}, {**got, "engine": 33.0, "other": 0.0}],
                                          [{**got, "engine": 30.0}, {**got, "engine": 30.0}])
    assert ratios["engine"]["total"] == pytest.approx(63 / 60) and ratios["api"]["geomean"] == pytest.approx(1.0)
    assert "other" not in ratios  # lookahead's segments had none to compare


def test_bench_serve_prices_each_method_against_plain_sync_wave_by_wave():
    bench_serve = _import_bench("bench_serve")
    cell = {"methods": {"plain": {"speedup_waves": [1.0, 1.0, 1.0]},
                        "plain-sync": {"speedup_waves": [0.9, 0.95, 0.92]},
                        "lookahead": {"speedup_waves": [0.9, 1.045, 0.92]}}}
    bench_serve.against_plain_sync(cell)
    got = cell["methods"]["lookahead"]["vs_plain_sync"]
    assert got["waves"] == pytest.approx([1.0, 1.1, 1.0])
    assert got["geomean"] == pytest.approx(1.1 ** (1 / 3))
    assert got["ci95"][0] < got["geomean"] < got["ci95"][1]
    assert "vs_plain_sync" not in cell["methods"]["plain"] and "vs_plain_sync" not in cell["methods"]["plain-sync"]
    alone = {"methods": {"plain": {"speedup_waves": [1.0]}, "lookahead": {"speedup_waves": [1.2]}}}
    bench_serve.against_plain_sync(alone)
    assert "vs_plain_sync" not in alone["methods"]["lookahead"]


def test_bench_serve_sustained_waves_keep_c_requests_in_flight(monkeypatch):
    bench_serve = _import_bench("bench_serve")
    args = bench_serve.parse_args(["--methods", "plain", "--concurrency", "1", "8", "--waves", "2", "--depth", "3"])
    assert args.counts == [6, 48]  # c * depth * waves
    live, peak, order = [0], [0], []

    async def fake_request(client, server, prompt, max_tokens, temperature=0.0, top_p=1.0):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        order.append(prompt)
        await asyncio.sleep(0.01 * (int(prompt) % 3))
        live[0] -= 1
        return 0.1, 0.01, max_tokens, f"out {prompt}"

    monkeypatch.setattr(bench_serve, "one_request", fake_request)
    server = types.SimpleNamespace(url="http://127.0.0.1:9")
    prompts = [str(i) for i in range(12)]
    _, results = asyncio.run(bench_serve.run_wave(server, prompts, 5, in_flight=3))
    assert peak[0] == 3  # never more than c out at once, and c kept busy
    assert order[:3] == ["0", "1", "2"] and sorted(order) == sorted(prompts)
    assert [r[3] for r in results] == [f"out {p}" for p in prompts]  # results in prompt order
    assert [r[4] for r in results[:3]] == pytest.approx([0.0] * 3, abs=0.005)  # the first c sent at once
    assert results[-1][4] >= 0.01  # the later ones only when a slot frees
    peak[0] = 0
    asyncio.run(bench_serve.run_wave(server, prompts, 5))  # a burst: all at once
    assert peak[0] == 12


def test_bench_serve_varied_lengths_give_each_prompt_one_cap_for_every_method(monkeypatch):
    bench_serve = _import_bench("bench_serve")
    args = bench_serve.parse_args(["--max-tokens", "128", "--vary-lengths", "16"])
    prompts = [f"prompt {i}" for i in range(200)]
    caps = bench_serve.length_caps(prompts, args)
    assert all(16 <= c <= 128 for c in caps) and len(set(caps)) > 20  # spread over the range
    assert bench_serve.length_caps(prompts[::-1], args) == caps[::-1]  # a prompt's cap follows the prompt
    assert bench_serve.length_caps(prompts, bench_serve.parse_args(["--max-tokens", "64"])) == [64] * 200
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--max-tokens", "64", "--vary-lengths", "65"])
    asked = {}

    async def fake_request(client, server, prompt, max_tokens, temperature=0.0, top_p=1.0):
        asked[prompt] = max_tokens, temperature, top_p
        return 0.1, 0.01, max_tokens, prompt

    monkeypatch.setattr(bench_serve, "one_request", fake_request)
    server = types.SimpleNamespace(url="http://127.0.0.1:9")
    asyncio.run(bench_serve.run_wave(server, prompts[:5], caps[:5], in_flight=2))
    assert asked == {p: (cap, 0.0, 1.0) for p, cap in zip(prompts[:5], caps[:5])}
    asyncio.run(bench_serve.run_wave(server, prompts[:2], caps[:2], in_flight=2, temperature=0.8))
    assert [asked[p] for p in prompts[:2]] == [(cap, 0.8, 1.0) for cap in caps[:2]]  # --temperature reaches each
    asyncio.run(bench_serve.run_wave(server, prompts[:3], caps[:3], in_flight=2, temperature=[0.0, 0.8, 0.0],
                                     top_p=0.9))  # --top-p reaches the sampled requests only
    assert [asked[p] for p in prompts[:3]] == [(caps[0], 0.0, 1.0), (caps[1], 0.8, 0.9), (caps[2], 0.0, 1.0)]
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--top-p", "0.9"])  # greedy requests have no top_p


def test_bench_serve_open_loop_sends_each_request_at_its_arrival(monkeypatch):
    bench_serve = _import_bench("bench_serve")
    times = bench_serve.poisson_arrivals(400, 2.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times) and times == bench_serve.poisson_arrivals(400, 2.0, seed=3)
    assert 400 / times[-1] == pytest.approx(2.0, rel=0.15)  # the asked rate
    assert times != bench_serve.poisson_arrivals(400, 2.0, seed=4)  # each wave its own draw
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--request-rate", "0"])

    async def fake_request(client, server, prompt, max_tokens, temperature=0.0, top_p=1.0):
        await asyncio.sleep(0.2)  # slower than the arrivals: an open loop does not wait for it
        return 0.2, 0.01, max_tokens, prompt

    monkeypatch.setattr(bench_serve, "one_request", fake_request)
    server = types.SimpleNamespace(url="http://127.0.0.1:9")
    _, results = asyncio.run(bench_serve.run_wave(server, list("abcd"), 5, None, [0.0, 0.05, 0.1, 0.15]))
    assert [r[4] for r in results] == pytest.approx([0.0, 0.05, 0.1, 0.15], abs=0.03)


def test_bench_serve_pairs_each_wave_request_by_request():
    bench_serve = _import_bench("bench_serve")
    # Waves of 2: (2/1, 4/1) -> sqrt(8); (1/1) with a zero request skipped -> 1.
    ratios = bench_serve.paired_wave_ratios([2.0, 4.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], 2)
    assert ratios == pytest.approx([8 ** 0.5, 1.0])
    assert bench_serve.paired_wave_ratios([0.0], [1.0], 1) == []


def test_serve_tails_counts_long_prompts_sent_while_a_request_ran():
    serve_tails = _import_bench("serve_tails")
    # One wave of 4: request 0 runs 0..10 s; long prompts (2000 tokens) are sent at 2 s (1) and 12 s (3).
    record = {"sent_s": [0.0, 2.0, 5.0, 12.0], "latency_s": [10.0, 1.0, 8.0, 1.0]}
    cell = {"concurrency": 2, "depth": 2, "prompt_tokens": [100, 2000, 100, 2000],
            "methods": {"plain": {"per_request": record}}}
    assert serve_tails.overlapped(cell, "plain", 1000) == [1, 0, 1, 0]  # request 2 runs 5..13 s: sees 3
    assert serve_tails.by_overlap(cell, "plain", 1000) == {0: (2, 1.0), 1: (2, 9.0)}
    assert serve_tails.overlapped(cell, "plain", 5000) == [0, 0, 0, 0]


def test_serve_by_class_pairs_requests_within_their_class(tmp_path):
    """Mixed traffic sends the classes round robin (a class that runs out drops out); each request's latency
    ratio lands in its own class, and a later cell's prompts follow the earlier cells'."""
    bench_serve = _import_bench("bench_serve")
    by_class = _import_bench("serve_by_class")
    assert bench_serve.round_robin([["a"] * 3, ["b"], ["c"] * 2]) == ["a", "b", "c", "a", "c", "a"]
    classes = ["a", "b", "c", "a", "c", "a"]

    def cell(concurrency, plain, mine, theirs):
        return {"dataset": "mixed", "concurrency": concurrency,
                "methods": {name: {"per_request": {"latency_s": lat}}
                            for name, lat in (("plain", plain), ("lookahead", mine), ("suffix", theirs))}}

    result = {"cells": [cell(8, [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]),  # prompts 0-1, another concurrency
                        cell(1, [4.0, 4.0, 4.0, 4.0], [1.0, 2.0, 3.0, 2.0], [2.0, 2.0, 1.0, 4.0])]}  # prompts 2-5
    got = by_class.ratios_by_class(result, classes, 1, "lookahead", "suffix")
    assert got == {"c": [(0.5, 0.25, 0.5), (3.0, 0.75, 0.25)], "a": [(1.0, 0.5, 0.5), (0.5, 0.5, 1.0)]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    pooled = by_class.main([str(path), str(path)])  # the test split's real classes: pooled over both files
    assert sum(row["requests"] for row in pooled.values()) == 8
    with pytest.raises(SystemExit, match=r"no lookahead:floor \(methods: plain, lookahead, suffix\)"):
        by_class.main([str(path), "--method", "lookahead:floor"])
    result["cells"][1]["methods"]["plain"].pop("per_request")
    path.write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="keeps no latency per request"):
        by_class.main([str(path)])


def test_serve_step_cost_reads_decode_steps_at_concurrency_one(tmp_path):
    """A request's decode steps are its tokens less the prefill's first less the draft tokens accepted, their
    time its latency less its TTFT; the extra draft tokens' price is the step ratios' difference over theirs."""
    step_cost = _import_bench("serve_step_cost")

    def method(tokens, accepted, draft_tokens, latency, ttft, waves):
        return {"tokens": tokens, "accepted_tokens": accepted, "draft_tokens": draft_tokens, "drafts": 10,
                "speedup_waves": waves, "per_request": {"latency_s": latency, "ttft_s": ttft}}

    # Two requests of 51 tokens: 100 decode steps for plain (1 s each request less 0.1 s TTFT: 9 ms a step).
    cell = {"dataset": "mixed", "concurrency": 1, "methods": {
        "plain": method(102, 0, 0, [1.0, 1.0], [0.1, 0.1], [1.0, 1.0]),
        "suffix": method(102, 50, 100, [0.6, 0.6], [0.1, 0.1], [1.5, 1.6]),  # 50 steps of 20 ms, 2 tokens each
        "lookahead": method(102, 60, 160, [0.58, 0.58], [0.1, 0.1], [1.65, 1.6])}}  # 40 steps of 24 ms, 4 each
    costs = step_cost.step_costs(cell)
    assert costs["plain"]["steps"] == 100 and costs["suffix"]["steps"] == 50 and costs["lookahead"]["steps"] == 40
    assert costs["lookahead"]["ms_per_step"] == pytest.approx(24.0)
    assert costs["suffix"]["over_plain"] == pytest.approx(20.0 / 18.0)
    assert costs["lookahead"]["draft_tokens_per_step"] == pytest.approx(4.0)
    versus = step_cost.compare(cell, costs, "lookahead", "suffix")
    assert versus["step_ratio"] == pytest.approx(1.2)
    assert versus["cost_per_extra_token"] == pytest.approx((24.0 - 20.0) / 18.0 / 2.0)
    assert versus["tok_s_ratio"] == pytest.approx((1.1 * 1.0) ** 0.5)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"cells": [dict(cell, concurrency=8), cell]}))
    assert list(step_cost.main([str(path)])) == ["r.json:mixed"]  # the concurrency-8 cell is left out
    with pytest.raises(SystemExit, match=r"no ngram \(methods: plain, suffix, lookahead\)"):
        step_cost.main([str(path), "--against", "ngram"])
    path.write_text(json.dumps({"cells": [dict(cell, concurrency=8)]}))
    with pytest.raises(SystemExit, match="no cell at concurrency 1"):
        step_cost.main([str(path)])
    del cell["methods"]["plain"]["per_request"]["ttft_s"]
    path.write_text(json.dumps({"cells": [cell]}))
    with pytest.raises(SystemExit, match="keeps no latency and TTFT per request"):
        step_cost.main([str(path)])


def test_tails_are_compared_wave_by_wave():
    bench_serve = _import_bench("bench_serve")
    serve_tails = _import_bench("serve_tails")
    # Waves of 2, the second on a machine twice as slow for both methods: each wave's ratio is the same. A
    # wave's p99 lies 0.99 of the way from its smaller value to its larger one.
    mine, plain = [1.0, 4.0, 2.0, 8.0], [1.0, 2.0, 2.0, 4.0]
    assert bench_serve.paired_wave_percentiles(mine, plain, 2) == pytest.approx([3.97 / 1.99, 7.94 / 3.98])
    assert bench_serve.paired_wave_percentiles(mine, plain, 2, q=0.0) == pytest.approx([1.0, 1.0])
    assert bench_serve.paired_wave_percentiles([], plain, 2) == []
    cell = {"concurrency": 2, "depth": 1, "methods": {
        "plain": {"per_request": {"latency_s": plain}}, "lookahead": {"per_request": {"latency_s": mine}}}}
    assert serve_tails.wave_p99(cell, "lookahead") == \
        "p99 over plain's wave by wave 1.99x (1.99-1.99), above 1 in 2 of 2 waves"


@pytest.mark.vllm
def test_bench_tree_verify_times_both_host_calls_and_digests_the_rows(tmp_path):
    """Each cell times begin_step and finish_step; the rows written depend on the walks alone
    (the same digest on a second run), and a window changes them."""
    bench = _import_bench("bench_tree_verify")
    argv = ["--trees", "3", "--steps", "2", "--vocab", "64", "--out", str(tmp_path / "tv.json")]
    cells = bench.main(argv)["cells"]
    assert [(c["trees"], c["window"]) for c in cells] == [(3, False), (3, True)]
    assert all(c["begin_step_ms"] > 0 and c["finish_step_ms"] > 0 for c in cells)
    again = bench.main(argv)["cells"]
    assert [c["rows_digest"] for c in again] == [c["rows_digest"] for c in cells]
    assert cells[0]["rows_digest"] != cells[1]["rows_digest"]
    saved = json.loads((tmp_path / "tv.json").read_text())
    assert saved["cells"] == again and saved["git"]["commit"]
    with pytest.raises(SystemExit):
        bench.main(["--nodes", "2", "--out", str(tmp_path / "x.json")])


@pytest.mark.slow  # 19 s: a lab benchmark's engines
def test_bench_arrivals_pairs_in_process_engines_at_the_same_arrivals(tiny_llama_dir, tmp_path):
    """The open loop without servers: every method gets the same arrivals and prompts each round;
    request by request ratios with an interval, each request's times in order, step periods."""
    out = tmp_path / "arrivals.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_arrivals.py"), "--model", tiny_llama_dir,
           "--methods", "plain", "lookahead", "--num-prompts", "2", "--rounds", "2", "--request-rate", "20",
           "--max-tokens", "6", "--max-model-len", "2048", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]["lookahead"]
    assert summary["requests"] == 4 and summary["mismatches"] == 0 and 0 <= summary["faster"] <= 4
    low, high = summary["latency"]["ci95"]
    assert low < summary["latency"]["ratio"] < high
    arrivals = {m: [(r["round"], r["prompt"], r["arrival_s"]) for r in rows] for m, rows in report["requests"].items()}
    assert arrivals["plain"] == arrivals["lookahead"]  # each request: the same prompt at the same arrival time
    assert [a[:2] for a in arrivals["plain"]] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    for method, rows in report["requests"].items():
        assert [r["round"] for r in rows] == [0, 0, 1, 1]
        assert all(0 < r["ttft_s"] <= r["latency_s"] and r["decode_s"] >= 0 for r in rows)
        assert len(report["step_periods"][method]) == 2  # one clock reading a round
    assert all(p["decode_drafted"]["steps"] == 0 for p in report["step_periods"]["plain"])
    assert report["other_cpu"]["wall_s"] > 0 and len(report["other_cpu"]["other_cpu_s_per_interval"]) == 4
    assert "lookahead over plain, request by request: latency" in proc.stdout


def test_bench_arrivals_rejects_bad_arguments(capsys):
    bench_arrivals = _import_bench("bench_arrivals")
    for argv, message in ((["--methods", "plain"], "needs two or more different methods"),
                          (["--methods", "plain", "plain"], "needs two or more different methods"),
                          (["--request-rate", "0"], "--request-rate 0.0: must be > 0"),
                          (["--rounds", "0"], "--rounds 0: must be >= 1"),
                          (["--max-tokens", "1"], "--max-tokens 1: must be >= 2"),
                          (["--methods", "plain", "nosuch"], "--methods 'nosuch'"),
                          (["--variant", "x={bad"], "--variant 'x={bad': not JSON"),
                          (["--variant", "x=[1]"], "--variant 'x=[1]': expected NAME=JSON object"),
                          (["--methods", "plain", "lookahead:x"], "--methods 'lookahead:x': no --variant x=JSON"),
                          (["--variant", "x={}"], "--variant x: not among --methods")):
        with pytest.raises(SystemExit):
            bench_arrivals.parse_args(argv)
        assert message in capsys.readouterr().err
    args = bench_arrivals.parse_args(["--methods", "plain", "lookahead:f", "--variant", 'f={"decoding_length": 4}'])
    assert args.variants == {"lookahead:f": {"decoding_length": 4}}
    offline = _import_bench("bench_offline")
    eargs = bench_arrivals.engine_args(args)
    assert offline.lookahead_config("lookahead:f", eargs) == {"decoding_length": 4}  # what build_engine applies
    assert offline.lookahead_config("lookahead", eargs) == {}


def test_replay_workloads_keep_sampled_outputs_apart(tmp_path):
    """``--temperature T`` replays plain's samples at T: cached under their own name, never the greedy
    outputs', and a negative temperature is refused naming the flag."""
    workloads = _import_bench("workloads")
    model = tmp_path / "model"
    greedy, sampled = ({"prompts": [[1, 2]], "outputs": [[3, 4]]}, {"prompts": [[1, 2]], "outputs": [[5, 6]]})
    (tmp_path / f"humaneval_dev_1_8_{model.name}.json").write_text(json.dumps(greedy))
    (tmp_path / f"humaneval_dev_1_8_{model.name}_t0.8.json").write_text(json.dumps(sampled))
    assert workloads.greedy_outputs("humaneval", 1, 8, model, tmp_path) == ([[1, 2]], [[3, 4]])
    assert workloads.greedy_outputs("humaneval", 1, 8, model, tmp_path, temperature=0.8) == ([[1, 2]], [[5, 6]])
    args = workloads.workload_parser("replay").parse_args(
        ["--datasets", "humaneval", "--num-prompts", "1", "--max-tokens", "8", "--cache", str(tmp_path),
         "--model", str(model), "--temperature", "0.8"])
    assert workloads.workloads(args) == [("humaneval", [[1, 2]], [[5, 6]])]
    args.temperature = -1.0
    with pytest.raises(SystemExit, match=r"--temperature -1.0: must be >= 0"):
        workloads.workloads(args)
