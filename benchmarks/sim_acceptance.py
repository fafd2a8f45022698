"""Acceptance simulator: mean accepted length of lookahead drafting, without the model.

Greedy verification is lossless, so at batch 1 the tokens a request emits are
exactly plain vLLM's greedy output, and what one step accepts is a pure
function of the draft tree and that output: the longest root-to-node path of
the tree that spells the next output tokens. This script generates the greedy
outputs once with plain vLLM (cached under ``--cache``), then replays the
proposer's trie on them for any number of config variants in seconds:

  step     context = prompt + output[:i]; the context chain and the trie
           draft a tree (budget after load adaptation, shape, confidence
           floor as the proposer would, the context chain leading); the
           step emits ``accepted + 1`` tokens (the bonus); the trie learns
           them; i advances.
  MAL      emitted tokens / steps (the first token, from prefill, excluded).
  raw_calibration
           per node kind and raw-confidence bin, how often the trie's
           retrieved nodes (before any cost cut) would have been accepted.
  speed    modeled speedup over plain decoding: emitted tokens / forwards,
           a step costing ``ForwardCost(1 + kept nodes, extra paths)`` plain
           forwards under this machine's model (default token costs, the CPU
           path rounds' measured setup and per-path cost for trees), whatever
           the variant drafts with; the draft is first cut by the variant's
           own forward-cost model exactly as the proposer does at batch 1,
           with confidences calibrated online from the steps so far
           (``calibrate_confidence``, core/calibration.py).
  whole_draft_steps, predraft_hit_steps
           (chains from the draft index) steps that accepted their whole
           draft (an empty one included), and of those the steps whose bonus
           token was the index's next token after the draft: the steps for
           which a draft prepared during the forward, for the predicted
           outcome "all accepted, then the index's next token" (the
           pre-drafting of branch prediction), would have been the right one.

Requests run one after another through one trie, like the benchmark's cold
``lookahead`` cell at bs=1 (``--batch B``: in waves of B that share each
step's budget, like its bs=B cells); ``--warm-prompts N`` first inserts the greedy
outputs of the next N prompts (the dev split), like ``lookahead-warm``.

Example::

    python benchmarks/sim_acceptance.py --datasets humaneval --num-prompts 16 \\
        --variant chain='{"draft_shape": "one"}' --variant hier='{"draft_shape": "hier"}'
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from lookahead_vllm.core.budget import ForwardCost, confidence_floor, forward_cost
from lookahead_lab.reference.planner import allocate_step_budget, opens_path
import numpy as np

from lookahead_vllm.core.config import LookaheadConfig, Settings, resolve
from lookahead_lab.reference import ReferenceCalibrator as ConfidenceCalibrator
from lookahead_lab.reference import drafter as make_drafter
from lookahead_lab.reference import padded_contexts, row_drafts
from lookahead_lab.reference.planner import best_path
from lookahead_vllm.core.load import load_scaled_budget
from lookahead_lab.reference.trees import accepted_path
from workloads import check_positive, plain_wave_forwards, workload_parser, workloads


def simulate(config: dict[str, Any] | LookaheadConfig | None, prompts: list[list[int]], outputs: list[list[int]],
             warm: list[list[int]], paths: tuple[float, float] | None = None, batch: int = 1,
             native: bool | None = None, platform: str = "cpu", classes: list[str] | None = None,
             per_class_calibration: bool = False) -> dict[str, Any]:
    """Replay the drafter over (prompt, greedy output) pairs; see the module docstring.
    ``config``: lookahead fields as the engine takes them (profile knobs under
    ``"_profile"``), resolved for ``platform``.
    ``paths``: (setup, per path) of tree attention's extra paths, for the
    proposer's decisions and the timing (default: the CPU path rounds').
    ``batch``: requests run in waves of this many, stepping together until
    the wave's last one finishes (as ``generate`` with that many prompts):
    each step shares the forward-cost model's budget across the wave's
    running requests, and plain decoding is timed over the same waves.
    ``platform``: whose token prices the proposer decides with and the
    steps are timed at ("cpu": this machine's; "gpu": the GPU defaults, paths
    free, as with the CUDA kernel).
    ``classes``: each request's traffic class (batch 1 only): the result adds
    ``by_class``, each class's modelled speed, steps, draft and accepted
    tokens; ``per_class_calibration``: each class learns its own calibration
    (an oracle that knows every request's class) instead of sharing one."""
    if classes is not None and batch != 1:
        raise ValueError(f"classes with batch={batch}: steps are one request's only at batch 1")
    config = resolve(config, platform=platform)
    drafter = make_drafter(config, native is not False)
    for ids in warm:
        drafter.warm(ids)
    cost, timing = batch1_cost(config, paths), batch1_cost(resolve(platform=platform), paths)
    calibrators: dict[str, ConfidenceCalibrator] = {}
    by_class: dict[str, dict[str, float]] = {}
    audit = ConfidenceCalibrator()  # raw confidences vs acceptance, every drafted node
    steps = emitted = nodes = off_chain = drafted = accepted_total = 0
    # Pre-drafting's outlook (chains from the draft index only): steps whose
    # whole draft was accepted, and of those the ones whose bonus token the
    # index predicted (see predraft_hit_steps below).
    predicts = config.draft_shape == "one" and config.source == "index"
    whole = hits = 0
    forwards = plain_forwards = 0.0
    per_step: list[tuple[int, int]] = []
    tree_mode = config.draft_shape != "one"
    for first in range(0, len(prompts), batch):
        wave = range(first, min(first + batch, len(prompts)))
        seqs = {r: list(prompts[r]) + outputs[r][:1] for r in wave}
        pos = {r: 1 for r in wave}
        # Plain decoding: one token per running request per step.
        lengths = [len(outputs[r]) - 1 for r in wave]
        plain_forwards += plain_wave_forwards(lengths, timing)
        name = "all" if classes is None else classes[first]
        calibrator = (calibrators.setdefault(name if per_class_calibration else "all", ConfidenceCalibrator())
                      if config.profile.calibrate_confidence else None)
        mine = by_class.setdefault(name, dict.fromkeys(("forwards", "plain_forwards", "steps", "draft_tokens",
                                                        "accepted_tokens"), 0.0))
        mine["plain_forwards"] += plain_wave_forwards(lengths, timing)
        before = (forwards, steps, drafted, accepted_total)
        running = [r for r in wave if pos[r] < len(outputs[r])]
        while running:
            floor = confidence_floor(config, len(running))
            for r in running:
                drafter.sync([r], [0], np.asarray([seqs[r]], np.int64), [len(seqs[r])], [len(prompts[r])])
            contexts = padded_contexts([seqs[r][-config.profile.max_match_length:] for r in running])
            budget = load_scaled_budget(config, len(running))  # as the proposer: load adaptation
            cut = np.full(len(running), not tree_mode)  # chain mode: the best path, as the proposer drafts
            drafts = row_drafts(drafter.draft(running, contexts, [budget] * len(running), floor, tree_mode, cut))
            trees, kinds = [], []
            for r, (tree, k) in zip(running, drafts):
                audit.observe(tree, k, accepted_path(tree, outputs[r][pos[r]:]))
                trees.append(tree)
                kinds.append(k)
            opens = [opens_path(t.parents) for t in trees]
            if cost.free_tokens:
                if calibrator is not None:
                    confs = [calibrator.calibrate(t, k) for t, k in zip(trees, kinds)]
                else:
                    confs = [[t.node_confidence(j) for j in range(len(t))] for t in trees]
                keep = allocate_step_budget(confs, None, len(running), cost, opens)
                trees = [t.truncate(n) for t, n in zip(trees, keep)]
                kinds = [k[:n] for k, n in zip(kinds, keep)]
            rounds = max(sum(o[:len(t)]) for o, t in zip(opens, trees))
            forwards += timing(len(running) + sum(len(t) for t in trees), rounds)
            for r, tree, k in zip(running, trees, kinds):
                out, i = outputs[r], pos[r]
                # The engine's greedy walk with the target tokens read from the output.
                accepted = accepted_path(tree, out[i:])
                if calibrator is not None:
                    calibrator.observe(tree, k, accepted)
                if predicts and len(accepted) == len(tree) and i + len(tree) < len(out):
                    whole += 1
                    hits += _predicted_bonus(drafter, r, len(tree)) == out[i + len(tree)]
                off = bool(accepted) and accepted[-1] not in best_path(tree)
                n = min(len(accepted) + 1, len(out) - i)  # + bonus token
                seqs[r].extend(out[i:i + n])
                pos[r] = i + n
                steps += 1
                emitted += n
                nodes += len(tree)
                drafted += len(tree)
                accepted_total += len(accepted)
                off_chain += off
                per_step.append((len(tree), len(accepted)))
            for r in running:
                if pos[r] >= len(outputs[r]):
                    drafter.finish(r)
            running = [r for r in running if pos[r] < len(outputs[r])]
        for key, now, then in zip(("forwards", "steps", "draft_tokens", "accepted_tokens"),
                                  (forwards, steps, drafted, accepted_total), before):
            mine[key] += now - then
    return {"mal": emitted / max(steps, 1), "speed": plain_forwards / max(forwards, 1e-9), "steps": steps,
            "tokens": emitted, "nodes_per_step": nodes / max(steps, 1), "off_chain_steps": off_chain,
            "draft_tokens": drafted, "accepted_tokens": accepted_total,
            "acceptance_per_drafted_token": accepted_total / max(drafted, 1),
            "whole_draft_steps": whole if predicts else None,
            "predraft_hit_steps": hits if predicts else None,
            "raw_calibration": audit.summary(),
            **({} if classes is None else {"by_class": {
                name: {**row, "speed": row["plain_forwards"] / max(row["forwards"], 1e-9)}
                for name, row in by_class.items()}})}


def _predicted_bonus(drafter: Any, slot: int, n: int) -> int:
    """The token the draft index expects after a request's first ``n`` draft
    tokens: its chain one token longer, no confidence floor (-1: none). A
    drafter that prepared the next step's draft while the forward runs, for
    the outcome "the whole draft accepted, then this token", would have had
    it right exactly when this is the bonus token."""
    tokens, _, _, lengths = drafter.draft_rows(np.asarray([slot]), np.asarray([n + 1]), 0.0, False)
    return int(tokens[0, n]) if lengths[0] > n else -1


def batch1_cost(config: Settings, paths: tuple[float, float] | None = None) -> ForwardCost:
    """The proposer's cost model for ``config``: its platform's path prices
    (the CPU's path rounds; free on a GPU, the CUDA kernel; chains open no
    paths), or ``paths`` = (setup, per path) instead."""
    cost = forward_cost(config)
    return cost if paths is None else dataclasses.replace(cost, path_setup=paths[0], per_path=paths[1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = workload_parser(__doc__)
    p.add_argument("--suffix", action="store_true",
                   help="also replay vLLM's suffix decoding (arctic_inference) on the same outputs")
    p.add_argument("--warm-prompts", type=int, default=0)
    p.add_argument("--batch", type=int, default=1, help="requests stepping together (waves, as generate())")
    p.add_argument("--rounds", type=int, default=1,
                   help="send the prompts this many times (later rounds repeat earlier requests, "
                        "as agent and templated traffic does)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="a lookahead config to replay (repeatable); default: chain and hier at decoding_length 8")
    p.add_argument("--path-cost", nargs=2, type=float, default=None, metavar=("SETUP", "PER_PATH"),
                   help="price of tree attention's extra paths, in forwards (default: the CPU path rounds'; "
                        "0 0: one kernel launch for all paths, as on a GPU)")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                   help="token prices the drafts are cut with and the steps timed at: this CPU's measured ones, "
                        "or the GPU defaults (64 tokens about free; tree paths free, as with the CUDA kernel)")
    p.add_argument("--mixed", action="store_true",
                   help="one run of the datasets' prompts interleaved round robin (as bench_serve.py's mixed "
                        "traffic at concurrency 1) through one drafter, reported by class; batch 1")
    p.add_argument("--per-class-calibration", action="store_true",
                   help="with --mixed: each class learns its own confidence calibration (knowing each request's "
                        "class) instead of the one the drafter shares")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.mixed and args.batch != 1:
        p.error(f"--mixed with --batch {args.batch}: a step is one request's only at batch 1")
    if args.per_class_calibration and not args.mixed:
        p.error("--per-class-calibration needs --mixed")
    check_positive(p, num_prompts=args.num_prompts, max_tokens=args.max_tokens, batch=args.batch, rounds=args.rounds)
    specs = args.variant or ['chain={"draft_shape": "one"}', 'hier={"draft_shape": "hier"}']
    variants = {}
    for spec in specs:
        name, _, raw = spec.partition("=")
        try:
            variants[name] = json.loads(raw or "{}")
            resolve(variants[name])  # refused here, naming the field, rather than mid-run
        except (json.JSONDecodeError, ValueError) as exc:
            p.error(f"--variant {spec!r}: {exc}")
    loaded = workloads(args, args.num_prompts + args.warm_prompts)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "cells": []}
    if args.mixed:
        return _mixed(args, loaded, variants, results)
    for dataset, prompts, outputs in loaded:
        warm = outputs[args.num_prompts:]
        prompts, outputs = prompts[:args.num_prompts] * args.rounds, outputs[:args.num_prompts] * args.rounds
        test = slice(0, len(prompts))
        for name, config in variants.items():
            r = simulate(config, prompts[test], outputs[test], warm, args.path_cost and tuple(args.path_cost), args.batch,
                         platform=args.platform)
            results["cells"].append({"dataset": dataset, "variant": name, **r})
            print(f"{dataset:10s} {name:16s} MAL {r['mal']:.3f}  speed {r['speed']:.3f}  nodes/step {r['nodes_per_step']:5.2f}  "
                  f"acc/drafted {r['acceptance_per_drafted_token']:.3f}  off-chain steps {r['off_chain_steps']}", flush=True)
        if args.suffix:
            from suffix_replay import replay_suffix

            r = replay_suffix(prompts[test], outputs[test], batch=args.batch,
                              timing=batch1_cost(resolve(platform=args.platform),
                                                 args.path_cost and tuple(args.path_cost)))
            results["cells"].append({"dataset": dataset, "variant": "suffix", **r})
            print(f"{dataset:10s} {'suffix':16s} MAL {r['mal']:.3f}  speed {r['speed']:.3f}  nodes/step "
                  f"{r['draft_tokens'] / max(r['steps'], 1):5.2f}  acc/drafted "
                  f"{r['acceptance_per_drafted_token']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


def _mixed(args: Any, loaded: list[tuple[str, list, list]], variants: dict[str, Any],
           results: dict[str, Any]) -> dict[str, Any]:
    """``--mixed``: every variant over the datasets' prompts interleaved round robin, by class."""
    from bench_serve import round_robin

    n = args.num_prompts
    items = round_robin([[(d, p, o) for p, o in zip(ps[:n] * args.rounds, os[:n] * args.rounds)]
                         for d, ps, os in loaded])
    warm = round_robin([os[n:] for _, _, os in loaded])
    classes, prompts, outputs = (list(col) for col in zip(*items))
    for name, config in variants.items():
        r = simulate(config, prompts, outputs, warm, args.path_cost and tuple(args.path_cost), 1,
                     platform=args.platform, classes=classes, per_class_calibration=args.per_class_calibration)
        r.pop("raw_calibration")
        results["cells"].append({"dataset": "mixed", "variant": name, **r})
        print(f"mixed      {name:16s} speed {r['speed']:.3f}  " + "  ".join(
            f"{c} {row['speed']:.3f}" for c, row in r["by_class"].items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
