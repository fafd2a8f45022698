"""Online token prices against the offline forward-cost curve, on this machine.

The proposer fits the forward-cost model's prices to its own decode steps
(core/prices.py). This checks the fit against the curve
``bench_forward_cost.py`` measures offline: for each batch size,

1. the offline curve: one engine whose proposer drafts ``n`` tokens per
   request, ``n`` cycling through ``--nodes`` step by step (so drift hits
   every size alike), median step time per scored-token count, relative to
   the smallest; measured before and after the online run and averaged;
2. the online fit: a lookahead engine (default configuration, prices
   measured online) generating the dev splits' prompts until it has run
   ``--steps`` decode steps at least; its live prices then;
3. the fitted curve of drafted steps ``(cost(T) + setup) / (cost(T_min) +
   setup)`` against the offline one at every offline point (the offline
   engine's proposer is not lookahead's, so even its draftless steps run the
   speculative path: every offline point carries the setup), within the
   scored-token range the online steps covered and beyond it (where the
   platform prior speaks).

    python benchmarks/bench_prices.py --batch 1 8 --out benchmarks/results/prices_online_vs_offline.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lookahead_lab.offline import apply_cpu_env  # noqa: E402

apply_cpu_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.bench_forward_cost import sweep_step_times, variable_kwargs  # noqa: E402


def offline_curve(llm: Any, batch: int, context: int, nodes: list[int], steps: int) -> dict[int, float]:
    """Median step time (s) per scored-token count, draft sizes cycling step by step."""
    rng = np.random.default_rng(batch)
    contexts = [rng.integers(100, 20000, size=context).tolist() for _ in range(batch)]
    times = sweep_step_times(llm, contexts, nodes, steps, interleave=True)
    return {batch * (n + 1): statistics.median(t) for n, t in times.items()}


def online_fit(llm: Any, prompts: list[str], batch: int, steps: int, max_tokens: int) -> dict[str, Any]:
    """Generate ``prompts`` ``batch`` at a time until the proposer timed
    ``steps`` decode steps; its live prices and the token range it saw."""
    from vllm import SamplingParams

    from lookahead_lab.offline import find_proposers

    (proposer,) = find_proposers(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    used = 0
    while proposer.prices.observed < steps:  # the engine runs at most `batch` requests: the batch stays full
        if used >= len(prompts):
            raise SystemExit(f"--steps={steps}: the prompts gave only {proposer.prices.observed} timed steps")
        llm.generate(prompts[used:used + 4 * batch], params, use_tqdm=False)
        used += 4 * batch
    fit = proposer.prices.fit()
    tokens, rows, seconds, count, drafted, context = proposer.prices.buckets()
    return {"free_tokens": fit.free_tokens, "marginal_tokens": fit.marginal_tokens, "draft_setup": fit.draft_setup,
            "row_price": fit.row_price, "context_price": fit.context_price,
            "step_ms": round(fit.step_seconds * 1e3, 3), "samples": fit.samples, "fit_buckets": fit.buckets,
            "timed_steps": proposer.prices.observed, "prompts": used,
            "tokens_seen": [int(tokens.min()), int(tokens.max())] if len(tokens) else None,
            "rows_seen": [int(rows.min()), int(rows.max())] if len(rows) else None,
            "prior": [proposer.prices.prior.free_tokens, proposer.prices.prior.marginal_tokens,
                      proposer.prices.prior.draft_setup, proposer.prices.prior.row_price,
                      proposer.prices.prior.context_price],
            # The live buckets the fit rests on (median tokens, rows, ms; samples; drafted; drafted rows'
            # context in thousands of tokens), to refit offline.
            "buckets": [[float(t), float(r), round(float(s) * 1e3, 3), int(n), bool(d), round(float(k), 3)]
                        for t, r, s, n, d, k in zip(tokens, rows, seconds, count, drafted, context)]}


def compare(curve: dict[int, float], fit: dict[str, Any], batch: int, context: int = 0) -> dict[str, Any]:
    """Fitted vs offline cost at every offline point (``batch`` rows each, of
    ``context`` tokens; past the smallest point every row drafts and pays its
    entry), relative to the smallest."""
    from lookahead_vllm.core.budget import ForwardCost

    cost = ForwardCost(fit["free_tokens"], fit["marginal_tokens"], draft_setup=fit.get("draft_setup", 0.0),
                       per_row=fit.get("row_price", 0.0), per_context=fit.get("context_price", 0.0)).at_rows(batch)
    entry = batch * float(cost.entry(context))
    base_t = min(curve)
    rows = []
    for t in sorted(curve):
        offline = curve[t] / curve[base_t]
        fitted = (cost.drafted(t) + (entry if t > base_t else 0.0)) / cost.drafted(base_t)
        rows.append({"tokens": t, "offline_ms": round(curve[t] * 1e3, 3), "offline_relative": round(offline, 4),
                     "fitted_relative": round(fitted, 4), "error": round(fitted / offline - 1, 4)})
    lo, hi = fit["tokens_seen"] or (0, 0)
    seen = [abs(r["error"]) for r in rows if lo <= r["tokens"] <= hi]
    return {"rows": rows, "max_error_in_range": max(seen) if seen else None,
            "max_error": max(abs(r["error"]) for r in rows)}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, res in zip(axes[0], results):
        rows = res["comparison"]["rows"]
        t = [r["tokens"] for r in rows]
        ax.plot(t, [r["offline_relative"] for r in rows], "o-", label="offline (bench_forward_cost)")
        fit = res["online"]
        ax.plot(t, [r["fitted_relative"] for r in rows], "s--",
                label=f"online fit: {fit['free_tokens']} free, +1 per {fit['marginal_tokens']:.1f}, "
                      f"setup {fit.get('draft_setup', 0.0):.3f}, row {fit.get('row_price', 0.0):.3f}, "
                      f"context {fit.get('context_price', 0.0):.3f}")
        if fit["tokens_seen"]:
            ax.axvspan(*fit["tokens_seen"], alpha=0.12, label="tokens the online steps scored")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens scored per step")
        ax.set_ylabel(f"step time / step at {t[0]} tokens")
        ax.set_title(f"batch {res['batch']}: max error {res['comparison']['max_error_in_range']:.1%} in range")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--nodes", nargs="+", type=int, default=[0, 2, 4, 8, 12, 16, 24, 32])
    p.add_argument("--curve-steps", type=int, default=16, help="timed steps per draft size, per pass")
    p.add_argument("--context", type=int, default=288)
    p.add_argument("--steps", type=int, default=200, help="decode steps the online fit must have timed")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--split", default="dev", choices=("dev", "test"))
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/prices_online_vs_offline.json")
    args = p.parse_args(argv)
    for name in ("curve_steps", "steps", "max_tokens", "context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if min(args.batch) < 1 or max(args.batch) > 64:
        p.error(f"--batch={args.batch}: each must be in [1, 64]")
    if min(args.nodes) < 0 or len(set(args.nodes)) < 2:
        p.error(f"--nodes={args.nodes}: at least two distinct sizes >= 0")
    from transformers import AutoTokenizer
    from vllm import LLM

    import lookahead_lab.datasets as datasets
    from lookahead_lab.offline import engine_kwargs
    from lookahead_vllm.models import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    per_class = [datasets.load_split(d, args.split, tok) for d in datasets.DATASETS]
    prompts = [p for group in zip(*per_class) for p in group]  # classes interleaved
    prompts = [p for p in prompts if len(tok(p).input_ids) + args.max_tokens < 2048]
    results = []
    for batch in args.batch:
        fixed = LLM(model=model, **variable_kwargs(max(args.nodes), max_num_seqs=max(batch, 8)))
        before = offline_curve(fixed, batch, args.context, args.nodes, args.curve_steps)
        print(f"batch {batch}: offline curve measured ({len(before)} points)", flush=True)
        llm = LLM(model=model, **engine_kwargs("lookahead", k=16, max_num_seqs=batch))
        online = online_fit(llm, prompts, batch, args.steps, args.max_tokens)
        print(f"batch {batch}: online fit {online}", flush=True)
        after = offline_curve(fixed, batch, args.context, args.nodes, args.curve_steps)
        curve = {t: (before[t] + after[t]) / 2 for t in before}
        comparison = compare(curve, online, batch, args.context)
        print(f"batch {batch}: max error {comparison['max_error_in_range']} in the online range, "
              f"{comparison['max_error']} over all points", flush=True)
        results.append({"batch": batch, "online": online, "comparison": comparison,
                        "drift": {t: round(after[t] / before[t] - 1, 4) for t in before}})
        del llm, fixed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": model, "split": args.split, "context": args.context,
                                    "cpu": os.cpu_count(), "results": results}, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
