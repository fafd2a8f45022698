"""Plot a length sweep from a ``bench_offline.py`` JSON (seed 000 Fig. 4/5 style).

Variants named ``<shape>-<axis><N>`` (axis ``d`` = decoding_length, ``b`` =
branch_length), e.g. ``--variant hier-d16='{"draft_shape":"hier","decoding_length":16}'``,
become one line per shape (``<shape>-<axis><N>-warm``, trie preloaded, a line
of its own): speedup over plain and mean acceptance length vs N, per
dataset/batch cell, with vLLM ngram's best as a reference line.

    python benchmarks/plot_sweep.py benchmarks/results/tree_sweep.json
    python benchmarks/plot_sweep.py chains.json trees.json --out sweep.png   # rows of two runs
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

NAME = re.compile(r"^lookahead:(?P<shape>[a-z]+)-(?P<axis>[db])(?P<n>\d+)(?P<warm>-warm)?$")
AXES = {"d": "decoding_length (draft nodes per step)", "b": "branch_length"}


def series(cell: dict) -> dict[tuple[str, str], list[tuple[int, dict]]]:
    lines: dict[tuple[str, str], list[tuple[int, dict]]] = defaultdict(list)
    for row in cell["methods"]:
        m = NAME.match(row["method"])
        if m:
            lines[(m["axis"], m["shape"] + (m["warm"] or ""))].append((int(m["n"]), row))
    return {key: sorted(points, key=lambda p: p[0]) for key, points in lines.items()}


def merge(reports: list[dict]) -> dict:
    """One report whose cells hold every run's rows (first run's row per method)."""
    cells: dict[tuple, dict] = {}
    for report in reports:
        for cell in report["cells"]:
            key = (cell["dataset"], cell.get("tenants", 0), cell["batch_size"])
            merged = cells.setdefault(key, {**cell, "methods": []})
            seen = {row["method"] for row in merged["methods"]}
            merged["methods"] += [row for row in cell["methods"] if row["method"] not in seen]
    return {"cells": list(cells.values())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, nargs="+",
                   help="bench_offline JSONs; rows of the same dataset/tenants/batch cell are merged, the first run's "
                        "row wins for a method in several (each row's speedup is against its own run's plain)")
    p.add_argument("--out", type=Path, default=None, help="PNG (default: <first json>_sweep.png)")
    args = p.parse_args(argv)
    report = merge([json.loads(path.read_text()) for path in args.json])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    fig, axes = plt.subplots(len(cells), 2, figsize=(10, 3.6 * len(cells)), squeeze=False)
    for (ax_speed, ax_mal), cell in zip(axes, cells):
        for (axis, shape), points in series(cell).items():
            xs = [n for n, _ in points]
            ax_speed.plot(xs, [r["speedup"] for _, r in points], "o-", label=f"{shape} ({axis})")
            ax_mal.plot(xs, [r["mean_acceptance_length"] or 1.0 for _, r in points], "o-", label=f"{shape} ({axis})")
        ngrams = [r for r in cell["methods"] if r["method"].startswith("ngram")]
        if ngrams:
            best = max(ngrams, key=lambda r: r["speedup"])
            ax_speed.axhline(best["speedup"], color="gray", linestyle="--", label=f"vLLM {best['method']}")
            ax_mal.axhline(best["mean_acceptance_length"] or 1.0, color="gray", linestyle="--")
        ax_speed.axhline(1.0, color="black", linewidth=0.6)
        for ax, label in ((ax_speed, "speedup vs plain vLLM"), (ax_mal, "mean acceptance length")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N")
            ax.set_ylabel(label)
            ax.set_title(f"{cell['dataset']} bs={cell['batch_size']}")
            ax.grid(alpha=0.3)
        ax_speed.legend(fontsize=8)
    fig.tight_layout()
    out = args.out or args.json[0].with_name(args.json[0].stem + "_sweep.png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
