"""Forward cost vs tokens scored per step, inside vLLM, on this machine.

A decode step that verifies ``n`` draft tokens scores ``n + 1`` tokens. This
measures the median step time of one request (fixed context) for each ``n``
with a proposer that always drafts ``n`` tokens (``FixedProposer`` through
vLLM's ``custom_class`` route), so the curve is vLLM's real forward plus its
verification overhead. The flat part of the curve is how big a draft is nearly
free (the "critical decoding length").

    python benchmarks/bench_forward_cost.py --nodes 0 1 2 4 8 16 32 64 \\
        --out benchmarks/results/forward_cost.json

``--paths`` measures what tree verification adds: for each ``nodes`` a fixed
token tree of that many nodes in P root branches (P = 1 is a chain) goes
through the lookahead proposer and tree verification every step
(``FixedTreeProposer``); each extra branch is one more root-to-leaf path for
the tree attention. The slope of step time over P, in plain decode steps, is
the per-path cost (``cost_per_path``).

    python benchmarks/bench_forward_cost.py --nodes 8 --paths 1 2 3 4 8 \\
        --out benchmarks/results/path_cost.json

``--drafting`` measures what a row that carries drafts costs at a given
context length: ``--batch`` requests of each ``--contexts`` length decode
together, and in each configuration ``RxN`` the first ``R`` of them draft
``N`` tokens (``DraftingRowsProposer``). Configurations run in blocks of
steps, in a shuffled order per round, and only steps inside a block are
timed (a step that follows another configuration is not).

    python benchmarks/bench_forward_cost.py --drafting 0x0 1x1 4x1 8x1 8x2 8x4 \\
        --batch 8 --contexts 512 2048 --out benchmarks/results/context_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lookahead_lab.reference.trees import DraftTree

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class FixedProposer:
    """Drafts ``num_speculative_tokens`` copies of token 0 for every request."""

    def __init__(self, vllm_config) -> None:
        self.n = vllm_config.speculative_config.num_speculative_tokens

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[0] * self.n if s else [] for s in sampled_token_ids]


class VariableProposer(FixedProposer):
    """Drafts ``VariableProposer.n`` (at most ``num_speculative_tokens``) copies of token 0:
    one engine measures every draft size (``sweep_step_times``)."""

    n = 0

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[0] * VariableProposer.n if s else [] for s in sampled_token_ids]


class DraftingRowsProposer(FixedProposer):
    """The first ``DraftingRowsProposer.rows`` rows draft ``DraftingRowsProposer.n``
    copies of token 0, the others nothing (``--drafting``)."""

    rows = 0
    n = 0

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        cls = DraftingRowsProposer
        return [[0] * cls.n if s and i < cls.rows else [] for i, s in enumerate(sampled_token_ids)]


def drafting_step_times(llm, contexts: list[list[int]], configs: list[tuple[int, int]], rounds: int,
                        block: int = 6, warm: int = 2, seed: int = 0) -> dict[tuple[int, int], list[float]]:
    """Step times of ``len(contexts)`` requests per configuration ``(rows, n)``
    (the first ``rows`` rows draft ``n`` tokens), in one engine whose proposer
    is :class:`DraftingRowsProposer`: each round runs every configuration for
    ``block`` steps in a shuffled order; a block's first ``warm`` steps (which
    verify or follow another configuration) are not timed."""
    proposer = _built("DraftingRowsProposer")
    rng = np.random.default_rng(seed)
    schedule: list[tuple[int, int]] = []
    for _ in range(rounds):
        for i in rng.permutation(len(configs)):
            schedule += [configs[i]] * block
    timed = [i % block >= warm for i in range(len(schedule))]

    def draft(config: tuple[int, int]) -> None:
        proposer.rows, proposer.n = config

    return timed_schedule(llm, contexts, configs, schedule, timed, max(n for _, n in configs) + 1, draft, (0, 0))


def _built(name: str) -> type:
    """This module's proposer class ``name`` as vLLM built it (by path: not
    this module's own when it runs as ``__main__``)."""
    import importlib

    return getattr(importlib.import_module("benchmarks.bench_forward_cost"), name)


def timed_schedule(llm, contexts: list[list[int]], labels: list, schedule: list, timed: list[bool], most: int,
                   draft, idle) -> dict:
    """Decodes one request per context for ``len(schedule)`` steps: before
    step ``i``, ``draft(schedule[i + 1])`` sets what it drafts (the next step
    verifies it), so step ``i``'s time is booked to ``schedule[i]`` where
    ``timed[i]``; ``most`` bounds the tokens a step emits per request. Per
    label (in ``labels``' order), the times; the requests are then aborted
    and ``draft(idle)`` called."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    room = engine.model_config.max_model_len - max(map(len, contexts)) - 1
    params = SamplingParams(temperature=0.0, max_tokens=min(len(schedule) * most + 4, room), ignore_eos=True)
    ids = prefill(engine, contexts, params)
    times: dict = {label: [] for label in labels}
    for i, label in enumerate(schedule):
        draft(schedule[min(i + 1, len(schedule) - 1)])
        start = time.perf_counter()
        engine.step()
        if timed[i]:
            times[label].append(time.perf_counter() - start)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    draft(idle)
    return times


def main_drafting(args: argparse.Namespace, model: str) -> None:
    """``--drafting``: step time per configuration and context length (module docstring)."""
    from vllm import LLM

    configs = [parse_drafting(c, args.batch) for c in args.drafting]
    if (0, 0) not in configs:
        configs.insert(0, (0, 0))
    kwargs = variable_kwargs(max(n for _, n in configs) or 1, max_model_len=max(args.contexts) + 512)
    kwargs["speculative_config"]["model"] = "benchmarks.bench_forward_cost.DraftingRowsProposer"
    llm = LLM(model=model, **kwargs)
    rng = np.random.default_rng(0)
    cells = []
    for context in args.contexts:
        contexts = [rng.integers(100, 20000, size=context).tolist() for _ in range(args.batch)]
        times = drafting_step_times(llm, contexts, configs, args.rounds)
        base = statistics.median(times[(0, 0)])
        cell = {"context": context, "batch": args.batch, "draftless_ms": round(1e3 * base, 3), "configs": []}
        for (rows, n), ts in times.items():
            ms = 1e3 * statistics.median(ts)
            cell["configs"].append({"drafting_rows": rows, "draft_tokens": n, "median_ms": round(ms, 3),
                                    "relative": round(ms / (1e3 * base), 3), "steps": len(ts)})
        cells.append(cell)
        print(f"batch {args.batch}, context {context}: draftless {1e3 * base:.1f} ms; " + ", ".join(
            f"{c['drafting_rows']}x{c['draft_tokens']} {c['relative']:.3f}" for c in cell["configs"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": model, "batch": args.batch, "rounds": args.rounds, "cells": cells},
                                   indent=1))
    plot_drafting(cells, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


def parse_drafting(text: str, batch: int) -> tuple[int, int]:
    """``"RxN"``: R rows (<= batch) drafting N tokens each."""
    try:
        rows, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--drafting {text!r}: must be RxN (rows x draft tokens), e.g. 4x1") from None
    if not 0 <= rows <= batch or n < 0 or (rows == 0) != (n == 0):
        raise SystemExit(f"--drafting {text!r}: rows must be in [0, --batch={batch}], tokens >= 0, "
                         "and both 0 or both positive")
    return rows, n


def plot_drafting(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{c['drafting_rows']}x{c['draft_tokens']}" for c in cells[0]["configs"]]
    width = 0.8 / len(cells)
    for i, cell in enumerate(cells):
        ax.bar(np.arange(len(labels)) + i * width, [c["relative"] for c in cell["configs"]], width,
               label=f"context {cell['context']}")
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("rows drafting x draft tokens each")
    ax.set_ylabel("step time / draftless step")
    ax.set_title(f"Cost of drafting rows by context, batch {cells[0]['batch']}, SmolLM2 fp32, CPU", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def variable_kwargs(max_nodes: int, **overrides) -> dict:
    """``LLM(...)`` kwargs of an engine whose drafts ``VariableProposer.n`` sets step by step."""
    from lookahead_lab.offline import engine_kwargs

    kwargs = engine_kwargs("plain", **overrides)
    kwargs["speculative_config"] = {"method": "custom_class", "num_speculative_tokens": max_nodes,
                                    "model": "benchmarks.bench_forward_cost.VariableProposer"}
    return kwargs


def prefill(engine, contexts: list[list[int]], params) -> list[str]:
    """Add one request per context and step until every one has its first token; their ids."""
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(contexts))]
    for req_id, context in zip(ids, contexts):
        engine.add_request(req_id, {"prompt_token_ids": context}, params)
    prefilling = set(ids)
    while prefilling:  # prefill, in as many chunks as the token budget needs
        prefilling -= {out.request_id for out in engine.step() if out.outputs and out.outputs[0].token_ids}
    return ids


def sweep_step_times(llm, contexts: list[list[int]], nodes: list[int], steps: int,
                     interleave: bool = False) -> dict[int, list[float]]:
    """Decode step times of ``len(contexts)`` requests for each draft size in ``nodes``, ``steps``
    each, in one engine built with :func:`variable_kwargs` (max_nodes >= max(nodes)).

    A step verifies what the step before drafted, and its time is booked to that size. The sizes
    run one after another (the first two steps of each untimed), or with ``interleave`` change
    every step, cycling through ``nodes`` (the first two steps untimed), so that the machine's
    drift falls on every size alike."""
    if interleave:
        verified = [nodes[i % len(nodes)] for i in range(len(nodes) * steps + 2)]
        timed = [i >= 2 for i in range(len(verified))]
    else:
        verified = [n for n in nodes for _ in range(steps + 2)]
        timed = [i % (steps + 2) >= 2 for i in range(len(verified))]
    proposer = _built("VariableProposer")
    return timed_schedule(llm, contexts, nodes, verified, timed, max(nodes) + 1,
                          lambda n: setattr(proposer, "n", n), 0)


def fixed_tree(nodes: int, paths: int) -> DraftTree:
    """``nodes`` nodes in ``paths`` root branches of near-equal length (DFS
    order); branch b repeats token 1000 + b, so siblings differ."""
    from lookahead_lab.reference.trees import DraftTree

    tokens, parents = [], []
    for b in range(paths):
        length = nodes // paths + (b < nodes % paths)
        for d in range(length):
            parents.append(-1 if d == 0 else len(tokens) - 1)
            tokens.append(1000 + b)
    return DraftTree(tuple(tokens), tuple(parents), (1.0,) * nodes, (1.0,) * nodes)


def _fixed_tree_proposer():
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    class FixedTreeProposer(LookaheadProposer):
        """The lookahead proposer, drafting ``fixed_tree(k, BENCH_TREE_PATHS)`` every step."""

        def _draft(self, req_id, tokens, num_tokens, budget, floor):
            return fixed_tree(self.k, int(os.environ["BENCH_TREE_PATHS"]))

    return FixedTreeProposer


def __getattr__(name: str):  # vLLM imports the class by path; build it lazily (needs vLLM)
    if name == "FixedTreeProposer":
        return _fixed_tree_proposer()
    raise AttributeError(name)


def step_times(model: str, n: int, contexts: list[list[int]], steps: int) -> list[float]:
    """Decode step times with one request per context, each drafting ``n`` tokens every step."""
    from vllm import LLM, SamplingParams

    from lookahead_lab.offline import engine_kwargs

    kwargs = engine_kwargs("plain")
    if n:
        kwargs["speculative_config"] = {
            "method": "custom_class", "model": "benchmarks.bench_forward_cost.FixedProposer",
            "num_speculative_tokens": n,
        }
    llm = LLM(model=model, **kwargs)
    engine = llm.llm_engine
    prefill(engine, contexts, SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    del llm
    return times[1:-1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", nargs="+", type=int, default=[0, 1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context", type=int, default=288, help="context tokens before decoding")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per point")
    p.add_argument("--paths", nargs="+", type=int, default=None,
                   help="tree mode: root branches per fixed tree of --nodes nodes (1 = chain)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together, each drafting --nodes tokens")
    p.add_argument("--drafting", nargs="+", default=None,
                   help="drafting-rows mode: configurations RxN (R of --batch rows draft N tokens each)")
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 2048], help="--drafting: context lengths")
    p.add_argument("--rounds", type=int, default=4, help="--drafting: blocks of each configuration")
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/forward_cost.json")
    args = p.parse_args(argv)
    if args.paths and (min(args.paths) < 1 or min(args.nodes) < max(args.paths)):
        p.error("--paths must be >= 1 and at most every --nodes value")
    if args.paths and args.batch != 1:
        p.error("--paths measures one request: leave --batch at 1")
    if not 1 <= args.batch <= 64:
        p.error(f"--batch={args.batch}: must be in [1, 64]")
    from lookahead_lab.offline import apply_cpu_env

    apply_cpu_env()
    from lookahead_vllm.models import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    rng = np.random.default_rng(0)
    contexts = [rng.integers(100, 20000, size=args.context).tolist() for _ in range(args.batch)]
    if args.paths:
        return main_paths(args, model, contexts[0])
    if args.drafting:
        return main_drafting(args, model)
    # The unit is always one request's plain decode step, so batch curves
    # read in the forward-cost model's units (core/budget.py).
    base = 1e3 * statistics.median(step_times(model, 0, contexts[:1], args.steps))
    print(f"batch 1, plain decode step: median {base:.1f} ms", flush=True)
    rows = []
    for n in args.nodes:
        times = step_times(model, n, contexts, args.steps)
        rows.append({"draft_tokens": n, "tokens_scored": args.batch * (n + 1),
                     "median_ms": round(1e3 * statistics.median(times), 3),
                     "p90_ms": round(1e3 * float(np.percentile(times, 90)), 3), "steps": len(times)})
        rows[-1]["relative"] = round(rows[-1]["median_ms"] / base, 3)
        print(f"batch {args.batch}, draft {n:3d} each -> scored {rows[-1]['tokens_scored']:4d}: "
              f"median {rows[-1]['median_ms']:.1f} ms = {rows[-1]['relative']:.3f} single-token steps", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"context": args.context, "batch": args.batch, "model": model,
                                    "single_token_ms": round(base, 3), "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"), args.batch)
    print(f"wrote {args.out}")


def tree_step_times(model: str, nodes: int, context: list[int], steps: int, paths: list[int]) -> dict[int, list[float]]:
    """Step times of one engine drafting ``fixed_tree(nodes, P)``, P cycling
    through ``paths`` step by step (so drift hits every P alike). A step
    verifies the tree drafted at the end of the step before it."""
    from vllm import LLM, SamplingParams

    from lookahead_lab.offline import engine_kwargs

    os.environ["BENCH_TREE_PATHS"] = str(paths[0])
    kwargs = engine_kwargs("plain")
    kwargs["speculative_config"] = {"method": "custom_class", "num_speculative_tokens": nodes,
                                    "model": "benchmarks.bench_forward_cost.FixedTreeProposer"}
    # Every node goes out: no cost model, no confidence floor.
    kwargs["additional_config"] = {"lookahead": {"draft_shape": "hier", "cost_free_tokens": 0,
                                                 "_profile": {"min_draft_confidence": 0.0}}}
    llm = LLM(model=model, **kwargs)
    engine = llm.llm_engine
    total = steps * len(paths) + 2
    params = SamplingParams(temperature=0.0, max_tokens=total * (nodes + 1), ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": context}, params)
    engine.step()  # prefill; drafts the first tree
    times: dict[int, list[float]] = {p: [] for p in paths}
    for i in range(total):
        drafted = paths[i % len(paths)]  # the tree this step verifies
        os.environ["BENCH_TREE_PATHS"] = str(paths[(i + 1) % len(paths)])  # the one it drafts
        start = time.perf_counter()
        engine.step()
        if i >= 2:  # warm-up
            times[drafted].append(time.perf_counter() - start)
    engine.abort_request(["r"])
    del llm
    return times


def main_paths(args: argparse.Namespace, model: str, context: list[int]) -> None:
    plain_ms = 1e3 * statistics.median(step_times(model, 0, [context], args.steps))
    print(f"plain decode step: median {plain_ms:.1f} ms", flush=True)
    rows, fits = [], {}
    for n in args.nodes:
        for p, times in tree_step_times(model, n, context, args.steps, args.paths).items():
            ms = 1e3 * statistics.median(times)
            rows.append({"nodes": n, "paths": p, "median_ms": round(ms, 3), "relative": round(ms / plain_ms, 3),
                         "steps": len(times)})
            print(f"{n:3d} nodes in {p} paths: median {ms:.1f} ms = {ms / plain_ms:.3f} plain steps", flush=True)
        pts = [(r["paths"], r["relative"]) for r in rows if r["nodes"] == n]
        fits[n] = round(float(np.polyfit(*zip(*pts), 1)[0]), 4) if len(pts) > 1 else None
        print(f"{n:3d} nodes: {fits[n]} plain steps per extra path (least squares)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"context": args.context, "model": model, "plain_ms": round(plain_ms, 3),
                                    "per_path_fit": fits, "rows": rows}, indent=1))
    plot_paths(rows, fits, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


def plot_paths(rows: list[dict], fits: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for n in sorted({r["nodes"] for r in rows}):
        pts = sorted((r["paths"], r["relative"]) for r in rows if r["nodes"] == n)
        ax.plot(*zip(*pts), "o-", label=f"{n} nodes (slope {fits[n]})")
    ax.set_xlabel("root-to-leaf paths in the tree (1 = chain)")
    ax.set_ylabel("step time / plain decode step")
    ax.set_title("Tree verification cost per path, SmolLM2-135M fp32, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(rows: list[dict], path: Path, batch: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_vllm.core.config import Profile

    prior = Profile.for_platform("cpu")
    cost = ForwardCost(prior.free_tokens, prior.marginal_tokens, per_row=prior.row_price)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    scored = [r["tokens_scored"] for r in rows]
    ax.plot(scored, [r["relative"] for r in rows], "o-", label="measured")
    # The prior's step cost: the row part plus the token price (ForwardCost's model).
    ax.plot(scored, [cost(t) + cost.per_row * (batch - 1) for t in scored], "--", label="cost model (CPU prior)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens scored per step (roots + drafts)")
    ax.set_ylabel("step time / single-token step")
    ax.set_title(f"vLLM forward cost, batch {batch}, SmolLM2-135M fp32, CPU", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
