"""With and without the CPU preload (tcmalloc + Intel OpenMP, lookahead_vllm/cpu_preload.py).

The preload must be in place when a process starts, so settings cannot be
interleaved inside one process: ``bench_offline.py`` runs once per setting and
round, settings alternating (off, on, off, on, ...), same prompts and
methods. Reported per (dataset, batch size, method): tokens/s of every run and
the ratio of the means, on / off; and the median ratio.

    python benchmarks/bench_cpu_preload.py                       # 2 rounds -> results/cpu_preload.{json,png}
    python benchmarks/bench_cpu_preload.py --from-runs off1.json on1.json off2.json on2.json   # aggregate only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
BENCH = ["--datasets", "humaneval", "chat", "--num-prompts", "6", "--max-tokens", "96", "--batch-sizes", "1", "8",
         "--methods", "plain", "suffix", "lookahead", "--split", "test"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(setting: str, out: Path) -> None:
    from lookahead_vllm import cpu_preload

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if setting == "on":
        env["LD_PRELOAD"] = ":".join(cpu_preload.preload_libs())
    cmd = [sys.executable, str(Path(__file__).parent / "bench_offline.py"), *BENCH, "--out", str(out)]
    log(f"[{setting}] {' '.join(cmd[1:])}")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


def aggregate(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    cells: dict[tuple, dict[str, list[float]]] = {}
    for setting, report in runs:
        for cell in report["cells"]:
            for row in cell["methods"]:
                key = (cell["dataset"], cell["batch_size"], row["method"])
                cells.setdefault(key, {"off": [], "on": []})[setting].append(row["tok_s"])
    rows = [{"dataset": d, "batch_size": b, "method": m, "tokens_per_s_off": v["off"], "tokens_per_s_on": v["on"],
             "on_over_off": statistics.mean(v["on"]) / statistics.mean(v["off"])}
            for (d, b, m), v in cells.items() if v["off"] and v["on"]]
    return {"rows": rows, "median_on_over_off": statistics.median(r["on_over_off"] for r in rows)}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['dataset']}\nbs{r['batch_size']} {r['method']}" for r in rows]
    ax.bar(range(len(rows)), [r["on_over_off"] for r in rows])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("tokens/s with preload / without")
    ax.set_title(f"tcmalloc + Intel OpenMP preload: median {report['median_on_over_off']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--from-runs", nargs="+", type=Path, default=None, metavar="JSON",
                   help="bench_offline outputs off, on, off, on, ... (aggregate only)")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_preload.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be >= 1")
    settings = ["off", "on"]
    if args.from_runs:
        if len(args.from_runs) % 2:
            p.error(f"--from-runs: {len(args.from_runs)} files; give off and on runs in pairs")
        runs = [(settings[i % 2], json.loads(f.read_text())) for i, f in enumerate(args.from_runs)]
    else:
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for setting in settings:
                    out = Path(tmp) / f"{setting}_{r}.json"
                    run(setting, out)
                    runs.append((setting, json.loads(out.read_text())))
    report = {"bench_offline_args": BENCH, "runs": len(runs), **aggregate(runs)}
    args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))
    for r in report["rows"]:
        log(f"{r['dataset']:10s} bs{r['batch_size']} {r['method']:10s} on/off {r['on_over_off']:.3f}")
    log(f"median on/off {report['median_on_over_off']:.3f} -> {args.out}")
    return report


if __name__ == "__main__":
    main()
