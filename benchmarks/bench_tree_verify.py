"""Tree verification's host work per step, without a model: ``TreeVerifier.begin_step`` (the
plans built from the handed-out offers included) and ``finish_step`` on a runner of plain objects.

Every request carries the same shape of tree (``--nodes`` verify nodes on two branches that part
halfway, optionally a Jacobi window of W = 4, N = 3 after them), all greedy; the logits are
random with each tree's first ``--follow`` rows made to pick its leading chain, so the walks go
that deep. A step is the verifier's two host calls on the same inputs (the attention layers'
part, ``fix_tree_rows``, is not timed); each cell reports the median over ``--steps`` and a
digest of the rows ``finish_step`` wrote (equal digests: equal walks, whatever the code).

Example::

    python benchmarks/bench_tree_verify.py --trees 32 256 --window off on
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from bench_offline import git_info, machine_info
from workloads import check_positive

RESULTS = Path(__file__).resolve().parent / "results"
WINDOW, NGRAM = 4, 3


def make_step(trees: int, nodes: int, window: bool, vocab: int, follow: int, seed: int = 0):
    """A runner, scheduler output, logits and spec metadata for ``trees`` greedy tree requests,
    handed out as the proposer does (a :class:`StepDrafts` over the offers' arrays, so
    ``begin_step`` builds each tree's plan as in the engine)."""
    from vllm import SamplingParams

    from lookahead_vllm.core.tree_plan import StepDrafts, TreeOffers

    rng = np.random.default_rng(seed)
    half = nodes // 2
    parents = list(range(-1, half - 1)) + [half // 2] + list(range(half, nodes - 1))  # two branches
    ahead_nodes = WINDOW * (NGRAM - 1) - 1
    tokens = rng.integers(0, vocab, (trees, nodes)).astype(np.int32)
    offers = TreeOffers(np.arange(trees, dtype=np.int64), tokens, np.tile(np.asarray(parents, np.int32), (trees, 1)),
                        np.full((trees, nodes), 0.5), np.zeros((trees, nodes), np.int8),
                        np.full(trees, nodes, np.int64), np.ones(trees, bool))
    windows = ({d: tuple(rng.integers(0, vocab, ahead_nodes).tolist()) for d in range(trees)} if window else {})
    req_ids = [f"r{d}" for d in range(trees)]
    handed_out = StepDrafts(offers, {r: d for d, r in enumerate(req_ids)}, windows, WINDOW, NGRAM)
    drafts = {r: tokens[d].tolist() + list(windows.get(d, ())) for d, r in enumerate(req_ids)}
    greedy = SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))
    states = dict.fromkeys(req_ids, greedy)
    num_tokens = np.array([len(d) + 1 for d in drafts.values()], np.int32)
    logits = torch.randn(int(num_tokens.sum()), vocab, generator=torch.Generator().manual_seed(seed))
    starts = np.cumsum(num_tokens) - num_tokens
    for i, req_id in enumerate(req_ids):
        for depth in range(min(follow, half)):
            logits[starts[i] + depth, drafts[req_id][depth]] += 50.0
    config = SimpleNamespace(profile=SimpleNamespace(debug_disable=("compaction",), jacobi_window=WINDOW,
                                                     jacobi_ngram=NGRAM), lookahead_nodes=ahead_nodes)
    drafter = SimpleNamespace(handed_out=handed_out, config=config, on_tree_truncated=lambda n: None,
                              on_tree_results=lambda results: None)
    runner = SimpleNamespace(drafter=drafter, requests=states, positions=torch.arange(int(num_tokens.sum())),
                             input_batch=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                                         generators={}))
    spec = SimpleNamespace(cu_num_sampled_tokens=torch.from_numpy(np.cumsum(num_tokens)))
    return runner, SimpleNamespace(scheduled_spec_decode_tokens=drafts), num_tokens, logits, spec


def run_cell(trees: int, nodes: int, window: bool, steps: int, vocab: int, follow: int) -> dict[str, Any]:
    from lookahead_vllm.vllm.tree_verify import TreeVerifier

    runner, sched, num_tokens, logits, spec = make_step(trees, nodes, window, vocab, follow)
    verifier = TreeVerifier()
    begin, finish = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        verifier.begin_step(runner, sched, num_tokens)
        t1 = time.perf_counter()
        out = SimpleNamespace(sampled_token_ids=torch.full((trees, nodes + 2), -1))
        t2 = time.perf_counter()
        verifier.finish_step(runner, logits, spec, out)
        finish.append(time.perf_counter() - t2)
        begin.append(t1 - t0)
    rows = out.sampled_token_ids.numpy().tobytes()
    return {"trees": trees, "nodes": nodes, "window": window, "steps": steps,
            "begin_step_ms": 1e3 * float(np.median(begin)), "finish_step_ms": 1e3 * float(np.median(finish)),
            "rows_digest": hashlib.blake2b(rows, digest_size=8).hexdigest()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", type=int, default=[32, 256])
    p.add_argument("--window", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--nodes", type=int, default=16, help="verify nodes a tree (two branches)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--follow", type=int, default=5, help="rows of each tree whose target is its leading chain's")
    p.add_argument("--out", type=Path, default=RESULTS / "tree_verify_host.json")
    args = p.parse_args(argv)
    check_positive(p, trees=args.trees, steps=args.steps, vocab=args.vocab)
    if args.nodes < 4:
        p.error(f"--nodes {args.nodes}: must be >= 4 (two branches)")
    if args.follow < 0:
        p.error(f"--follow {args.follow}: must be >= 0")
    cells = []
    for trees in args.trees:
        for window in args.window:
            cell = run_cell(trees, args.nodes, window == "on", args.steps, args.vocab, args.follow)
            cells.append(cell)
            print(f"{trees:4d} trees, window {window:3s}: begin_step {cell['begin_step_ms']:.3f} ms, finish_step "
                  f"{cell['finish_step_ms']:.3f} ms (median of {args.steps}); rows {cell['rows_digest']}", flush=True)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "machine": machine_info(), "git": git_info(), "torch": torch.__version__, "cells": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
