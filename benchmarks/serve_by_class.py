"""Where a method wins or loses on mixed traffic: paired request by request, its latency over
another method's, by the class each prompt came from (``bench_serve.py --datasets mixed`` results,
which keep every request's latency in prompt order).

    python benchmarks/serve_by_class.py benchmarks/results/serve_mixed_c1_*.json --method lookahead --against suffix

prints, per class, the requests pooled over the files' cells at ``--concurrency``, the geometric
mean of the latency ratio with its 95% interval, and each method's latency over plain's.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

from bench_serve import MIXED, round_robin
from paired import ratio_interval


@functools.cache  # read once per split, however many files
def mixed_classes(split: str) -> list[str]:
    """The class of each prompt of ``--datasets mixed`` for ``split``, in the order it sends them."""
    from lookahead_lab.datasets import DATASETS, split_prompts

    return round_robin([[d] * len(split_prompts(d, split)) for d in DATASETS])


def ratios_by_class(result: dict, classes: list[str], concurrency: int, method: str,
                    against: str) -> dict[str, list[tuple[float, float, float]]]:
    """Per class, each request's (method over against, method over plain, against over plain) latency
    in the mixed cells at ``concurrency``; a cell's first prompt follows the earlier cells' counts."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    first = 0
    for cell in result["cells"]:
        count = len(cell["methods"]["plain"]["per_request"]["latency_s"])
        if cell["dataset"] == MIXED and cell["concurrency"] == concurrency:
            latency = {m: cell["methods"][m]["per_request"]["latency_s"] for m in ("plain", method, against)}
            for i, (p, a, b) in enumerate(zip(latency["plain"], latency[method], latency[against])):
                out.setdefault(classes[first + i], []).append((a / b, a / p, b / p))
        if cell["dataset"] == MIXED:
            first += count
    return out


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--method", default="lookahead")
    parser.add_argument("--against", default="suffix")
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args(argv)
    pooled: dict[str, list[tuple[float, float, float]]] = {}
    for path in args.files:
        result = json.loads(path.read_text())
        if any("per_request" not in row for cell in result["cells"] for row in cell["methods"].values()):
            raise SystemExit(f"{path}: keeps no latency per request (written before bench_serve.py kept them)")
        missing = {args.method, args.against} - {m for cell in result["cells"] for m in cell["methods"]}
        if missing:
            raise SystemExit(f"{path}: no {', '.join(sorted(missing))} (methods: "
                             f"{', '.join(result['cells'][0]['methods'])})")
        split = result.get("args", {}).get("split", "test")
        for name, rows in ratios_by_class(result, mixed_classes(split), args.concurrency, args.method,
                                          args.against).items():
            pooled.setdefault(name, []).extend(rows)
    if not pooled:
        raise SystemExit(f"no mixed cell at concurrency {args.concurrency} in {', '.join(map(str, args.files))}")
    out = {}
    for name, rows in pooled.items():
        mean, low, high = ratio_interval([r[0] for r in rows])
        over_plain = [math.exp(sum(math.log(r[k]) for r in rows) / len(rows)) for k in (1, 2)]
        out[name] = {"requests": len(rows), "ratio": mean, "ci95": [low, high], "method_over_plain": over_plain[0],
                     "against_over_plain": over_plain[1]}
        interval = "" if low is None else f" ({low:.3f}-{high:.3f})"
        print(f"{name:10s} {len(rows):4d} requests: {args.method} latency over {args.against}'s {mean:.3f}x{interval}; "
              f"over plain's {over_plain[0]:.3f}x, {args.against} {over_plain[1]:.3f}x")
    return out


if __name__ == "__main__":
    main()
