"""What a warm start buys: cold vs warm drafting on the acceptance simulator.

For each dataset class, the cached greedy outputs of ``2 * N`` dev prompts
(``workloads.greedy_outputs``) are split in two halves. Fold A replays
the first half cold (empty drafter) and warm (the drafter first learns the
second half's outputs, as ``warm_start`` or a loaded snapshot would give it);
fold B swaps the halves. Reported per class and variant: MAL and the modeled
speedup over plain decoding (sim_acceptance's ``speed``), cold and warm, both
folds pooled (token-weighted means of the two folds).

Example::

    python benchmarks/warm_start_gain.py --datasets humaneval codeedit mtbench \\
        --num-prompts 8 --out benchmarks/results/warm_start_gain.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_acceptance import simulate  # noqa: E402
from workloads import DEFAULT_CACHE, greedy_outputs  # noqa: E402

from lookahead_vllm.core.config import resolve  # noqa: E402


def fold(config: dict, prompts, outputs, test: slice, warm: slice) -> dict[str, dict[str, float]]:
    cold = simulate(config, prompts[test], outputs[test], [])
    hot = simulate(config, prompts[test], outputs[test], outputs[warm])
    tokens = sum(len(o) for o in outputs[test])
    return {"cold": cold, "warm": hot, "tokens": tokens}


def pooled(folds: list[dict], mode: str, key: str) -> float:
    total = sum(f["tokens"] for f in folds)
    return sum(f[mode][key] * f["tokens"] for f in folds) / total


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [f"{r['dataset']}\n{r['variant']}" for r in rows]
    x = range(len(rows))
    for ax, key, title in ((axes[0], "mal", "mean accepted length"), (axes[1], "speed", "modeled speedup")):
        ax.bar([i - 0.2 for i in x], [r[f"cold_{key}"] for r in rows], 0.4, label="cold")
        ax.bar([i + 0.2 for i in x], [r[f"warm_{key}"] for r in rows], 0.4, label="warm")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["humaneval", "codeedit"])
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per half (2x are read from the cache)")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="a lookahead config (repeatable); default: the default config as a chain and a tree")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--out", type=Path, default=None, help="JSON here, PNG beside it")
    args = p.parse_args(argv)
    if args.model is None:
        from lookahead_vllm.models import prepare_smollm2

        args.model = prepare_smollm2()
    specs = args.variant or ['chain={"draft_shape": "one"}', 'hier={"draft_shape": "hier"}']
    variants = {}
    for spec in specs:
        name, _, raw = spec.partition("=")
        variants[name] = json.loads(raw or "{}")
        resolve(variants[name])  # refused here, naming the field
    n = args.num_prompts
    rows = []
    for dataset in args.datasets:
        prompts, outputs = greedy_outputs(dataset, 2 * n, args.max_tokens, args.model, args.cache)
        for name, config in variants.items():
            folds = [fold(config, prompts, outputs, slice(0, n), slice(n, 2 * n)),
                     fold(config, prompts, outputs, slice(n, 2 * n), slice(0, n))]
            row = {"dataset": dataset, "variant": name}
            for mode in ("cold", "warm"):
                for key in ("mal", "speed"):
                    row[f"{mode}_{key}"] = round(pooled(folds, mode, key), 4)
            row["speed_gain"] = round(row["warm_speed"] / row["cold_speed"] - 1, 4)
            row["folds"] = [{m: {k: round(f[m][k], 4) for k in ("mal", "speed")} for m in ("cold", "warm")}
                            for f in folds]
            row["config"] = dict(config)
            rows.append(row)
            print(f"{dataset:10s} {name:8s} MAL {row['cold_mal']:.3f} -> {row['warm_mal']:.3f}  "
                  f"speed {row['cold_speed']:.3f} -> {row['warm_speed']:.3f} ({100 * row['speed_gain']:+.1f}%)",
                  flush=True)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
        plot(rows, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
