"""What a serving tail is made of: each method's request latency by how many long
prompts were sent to its server while the request ran (``bench_serve.py`` results,
which keep every request's send time, latency and prompt length).

    python benchmarks/serve_tails.py benchmarks/results/serve_mixed_c8_sustained_run2.json --long 1000

prints, per method, the median latency (and the requests) with 0, 1, 2, ... long
prompts sent during a request's lifetime, its slowest requests, and its p99 over plain's
wave by wave.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_serve import paired_wave_percentiles
from paired import ratio_interval


def overlapped(cell: dict, method: str, long_tokens: int) -> list[int]:
    """Per request: the other requests of its wave with a prompt over ``long_tokens`` tokens
    sent to ``method``'s server after it and before it finished."""
    size = cell["concurrency"] * cell.get("depth", 1)
    lengths = cell["prompt_tokens"]
    r = cell["methods"][method]["per_request"]
    sent, latency = r["sent_s"], r["latency_s"]
    out = []
    for i in range(len(lengths)):
        lo = i // size * size
        out.append(sum(1 for j in range(lo, min(lo + size, len(lengths)))
                       if j != i and lengths[j] > long_tokens and sent[i] < sent[j] < sent[i] + latency[i]))
    return out


def by_overlap(cell: dict, method: str, long_tokens: int) -> dict[int, tuple[int, float]]:
    """Overlapped long prompts -> (requests, their median latency in s)."""
    latency = cell["methods"][method]["per_request"]["latency_s"]
    groups: dict[int, list[float]] = {}
    for n, lat in zip(overlapped(cell, method, long_tokens), latency):
        groups.setdefault(n, []).append(lat)
    return {n: (len(v), statistics.median(v)) for n, v in sorted(groups.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a bench_serve.py JSON (one cell per concurrency)")
    parser.add_argument("--long", type=int, default=1000, help="a prompt over this many tokens counts as long")
    args = parser.parse_args(argv)
    for cell in json.loads(args.results.read_text())["cells"]:
        if "prompt_tokens" not in cell:
            raise SystemExit(f"{args.results}: no per-request records (bench_serve.py keeps them since they were added)")
        lengths = cell["prompt_tokens"]
        print(f"c={cell['concurrency']}: {len(lengths)} prompts, {sum(n > args.long for n in lengths)} over {args.long} "
              f"tokens, median prompt {statistics.median(lengths):g}")
        for method, row in cell["methods"].items():
            groups = ", ".join(f"{n}: {m:.2f} s ({k})" for n, (k, m) in by_overlap(cell, method, args.long).items())
            lat = row["per_request"]["latency_s"]
            slowest = sorted(range(len(lat)), key=lambda i: -lat[i])[:3]
            print(f"  {method:12s} by long prompts sent while it ran: {groups}; slowest: "
                  + ", ".join(f"{lat[i]:.1f} s ({lengths[i]}-token prompt)" for i in slowest))
            if method != "plain":
                print(f"  {'':12s} {wave_p99(cell, method)}")


def wave_p99(cell: dict, method: str) -> str:
    """The method's p99 latency over plain's wave by wave (bench_serve.paired_wave_percentiles): the
    geometric mean, its 95% interval and the waves above 1, which tell a tail from the machine's drift."""
    size = cell["concurrency"] * cell.get("depth", 1)
    ratios = paired_wave_percentiles(cell["methods"][method]["per_request"]["latency_s"],
                                     cell["methods"]["plain"]["per_request"]["latency_s"], size)
    mean, low, high = ratio_interval(ratios)
    interval = "" if low is None else f" ({low:.2f}-{high:.2f})"
    return (f"p99 over plain's wave by wave {mean:.2f}x{interval}, above 1 in {sum(r > 1 for r in ratios)} of "
            f"{len(ratios)} waves")


if __name__ == "__main__":
    main()
