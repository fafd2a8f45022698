"""The demo's verdict: one line per method from a ``bench_offline.py`` JSON; exit 1 on any mismatch.

    python scripts/demo_summary.py RESULT.json

A mismatch is a prompt whose greedy output differs from plain vLLM's: lookahead
(and every other speculative method) must produce identical tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def verdict(report: dict) -> tuple[list[str], int]:
    """(lines to print, number of mismatched prompts over all cells and methods)."""
    lines, mismatches = [], 0
    for cell in report.get("cells", []):
        for row in cell["methods"]:
            mismatches += row["mismatches"]
            if row["mismatches"]:
                lines.append(f"MISMATCH: {cell['dataset']} bs={cell['batch_size']} {row['method']}: "
                             f"{row['mismatches']} prompt(s) differ from plain vLLM")
    if not report.get("cells"):
        lines.append("no results: the benchmark wrote no cell")
        return lines, -1
    if not mismatches:
        best = max((row for cell in report["cells"] for row in cell["methods"]), key=lambda r: r["speedup"])
        lines.append(f"0 mismatches: every method's output is identical to plain vLLM "
                     f"(fastest: {best['method']}, {best['speedup']:.2f}x plain)")
    return lines, mismatches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="JSON written by benchmarks/bench_offline.py")
    args = parser.parse_args(argv)
    lines, mismatches = verdict(json.loads(args.result.read_text()))
    print("\n".join(lines))
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
