"""The serving load curve from ``bench_serve.py`` results: every method's tok/s
over plain against concurrency, each cell's paired waves pooled over the files
given for it (geometric mean, 95% t interval: ``paired.ratio_interval``).

    python benchmarks/plot_load_curve.py \\
        1=benchmarks/results/serve_mixed_c1_40waves.json \\
        32=benchmarks/results/serve_mixed_c32_9waves.json,benchmarks/results/serve_mixed_c32_9waves_run2.json \\
        --out benchmarks/results/serve_load_curve.json

writes the pooled table as JSON and the plot next to it (``.png``). ``FILE@ROW`` takes the file's row ``ROW``
(a ``lookahead:NAME`` variant run with what is now the default) as its lookahead row, in place of its own;
``FILE@-`` leaves its lookahead row out (run with settings that are no longer the default) and pools the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from paired import ratio_interval


def pooled(concurrency: int, files: list[Path], lookahead_rows: dict[Path, str | None] | None = None
           ) -> dict[str, dict]:
    """Per method (plain and ``lookahead:NAME`` variants excluded; ``lookahead_rows`` maps a file to the row that
    stands for lookahead in it, None for none): the waves of every file's cell at
    ``concurrency``, pooled, and the geometric mean over files of its p99 latency and TTFT p50 over plain's
    in the same file. Files of one wave kind only: bursts, or sustained waves of one ``--depth`` (at c=1 both keep
    one request in flight and pool), with one cap on answers or the same ``--vary-lengths``, closed loop or one
    ``--request-rate``."""
    waves: dict[str, list[float]] = {}
    tails: dict[str, list[tuple[float, float]]] = {}
    kinds: dict[tuple, Path] = {}
    for path in files:
        result = json.loads(path.read_text())
        cells = [c for c in result["cells"] if c["concurrency"] == concurrency]
        if len(cells) != 1:
            raise SystemExit(f"{path}: {len(cells) or 'no'} cells at concurrency {concurrency} (one class a file)")
        methods = cells[0]["methods"]
        if "plain" not in methods:
            raise SystemExit(f"{path}: no plain row at concurrency {concurrency} to pair with")
        depth = 1 if concurrency == 1 else cells[0].get("depth", 1)
        args = result.get("args", {})
        kinds.setdefault((depth, args.get("vary_lengths"), args.get("request_rate")), path)
        if len(kinds) > 1:
            raise SystemExit(f"concurrency {concurrency}: waves of (--depth, --vary-lengths, --request-rate) "
                             f"{sorted(kinds, key=str)} "
                             f"({', '.join(map(str, kinds.values()))}); pool one kind of wave")
        plain = methods["plain"]
        chosen = (lookahead_rows or {}).get(path, "lookahead")
        if chosen is not None and chosen not in methods:
            raise SystemExit(f"{path}: no row {chosen!r} at concurrency {concurrency} (rows: {sorted(methods)})")
        methods = {name: row for name, row in methods.items() if name != "lookahead" and ":" not in name}
        if chosen is not None:
            methods["lookahead"] = cells[0]["methods"][chosen]
        for name, row in methods.items():
            if name != "plain":
                waves.setdefault(name, []).extend(row["speedup_waves"])
                if "latency_p99_s" in row:
                    tails.setdefault(name, []).append((row["latency_p99_s"] / plain["latency_p99_s"],
                                                       row["ttft_p50_s"] / plain["ttft_p50_s"]))
    (depth, vary, rate), = kinds
    out = {}
    for name, ratios in waves.items():
        mean, low, high = ratio_interval(ratios)
        out[name] = {"speedup": mean, "ci95": [low, high], "waves": len(ratios), "depth": depth,
                     "vary_lengths": vary, "request_rate": rate}
        if tails.get(name):
            out[name]["p99_ratio"] = statistics.geometric_mean(p for p, _ in tails[name])
            out[name]["ttft_p50_ratio"] = statistics.geometric_mean(t for _, t in tails[name])
    return out


def plot(curve: dict[int, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    levels = sorted(curve)
    methods = sorted({m for cell in curve.values() for m in cell}, key=lambda m: (m == "lookahead", m))
    for j, name in enumerate(methods):
        xs = [i + 0.08 * (j - (len(methods) - 1) / 2) for i, c in enumerate(levels) if name in curve[c]]
        rows = [curve[c][name] for c in levels if name in curve[c]]
        ys = [r["speedup"] for r in rows]
        bounds = [(r["ci95"][0] or y, r["ci95"][1] or y) for y, r in zip(ys, rows)]  # one wave: no interval
        err = [[y - lo for y, (lo, _) in zip(ys, bounds)], [hi - y for y, (_, hi) in zip(ys, bounds)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name, lw=2 if name == "lookahead" else 1)
    ax.axhline(1.0, ls="--", color="gray", lw=0.8)
    ax.set_xticks(range(len(levels)), [f"c={c}" for c in levels])
    ax.set_ylabel("output tok/s over plain (95% interval)")
    depths = {row.get("depth", 1) for cell in curve.values() for row in cell.values()}
    kind = "bursts of c requests" if depths == {1} else "sustained, at most c in flight"
    if any(row.get("vary_lengths") for cell in curve.values() for row in cell.values()):
        kind += ", answers of varied length"
    ax.set_title(f"serving load curve, mixed test traffic ({kind})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[int, dict[str, dict]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="+", metavar="C=FILE[@ROW][,FILE...]",
                        help="a concurrency and the bench_serve.py results whose waves it pools (repeatable); "
                             "@ROW: the file's row that stands for lookahead, @-: none")
    parser.add_argument("--out", type=Path, required=True, help="JSON path (the plot: the same name, .png)")
    args = parser.parse_args(argv)
    files: dict[int, list[Path]] = {}
    rows: dict[Path, str | None] = {}
    for spec in args.cells:  # a concurrency given twice pools both specs' files
        level, _, names = spec.partition("=")
        if not level.isdigit() or not names:
            parser.error(f"{spec!r}: expected C=FILE[@ROW][,FILE...], C a concurrency")
        for name in names.split(","):
            path, at, row = name.partition("@")
            if at and not row:
                parser.error(f"{spec!r}: {name!r} names no row after '@' (a row, or '-' for none)")
            files.setdefault(int(level), []).append(Path(path))
            if at:
                rows[Path(path)] = None if row == "-" else row
    curve = {level: pooled(level, paths, rows) for level, paths in files.items()}
    args.out.write_text(json.dumps({"cells": {str(c): curve[c] for c in sorted(curve)}, "sources": args.cells},
                                   indent=2) + "\n")
    plot(curve, args.out.with_suffix(".png"))
    for c in sorted(curve):
        print(f"c={c}: " + ", ".join(f"{m} {r['speedup']:.2f}x ("
                                     + (f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}, " if r['waves'] > 1 else "")
                                     + f"{r['waves']} waves"
                                     + (f"; p99 {r['p99_ratio']:.2f}x, TTFT p50 {r['ttft_p50_ratio']:.2f}x"
                                        if "p99_ratio" in r else "") + ")" for m, r in curve[c].items()))
    return curve


if __name__ == "__main__":
    main()
