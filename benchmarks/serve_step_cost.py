"""What a decoding step cost each server at concurrency 1, read back from ``bench_serve.py`` results that keep
every request's latency and TTFT: a request decodes alone there, so its latency less its TTFT is its decode
steps' time, and its steps are its tokens less the first (the prefill's) less the draft tokens accepted.

    python benchmarks/serve_step_cost.py benchmarks/results/serve_mixed_c1_*.json --method lookahead --against suffix

prints per file plain's milliseconds a step, then per method its decode steps, its step time over plain's and the
draft tokens it verified a step; and ``--method`` against ``--against``: how much longer its steps were per extra
draft token a step (in plain steps; how dear one more draft token was on that machine that day), and its
tok/s over the other's wave by wave with the 95% interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paired import ratio_interval


def step_costs(cell: dict) -> dict[str, dict[str, float]]:
    """Per method of a concurrency-1 cell: decode steps, seconds, ms a step, the step over plain's, draft tokens
    and drafts (steps that carried a draft) a step."""
    out = {}
    for name, m in cell["methods"].items():
        per = m["per_request"]
        steps = m["tokens"] - len(per["latency_s"]) - m["accepted_tokens"]
        seconds = sum(per["latency_s"]) - sum(per["ttft_s"])
        if steps <= 0:
            raise ValueError(f"{name}: {m['tokens']} tokens over {len(per['latency_s'])} requests leave no decode step")
        out[name] = {"steps": steps, "seconds": seconds, "ms_per_step": 1000.0 * seconds / steps,
                     "draft_tokens_per_step": m["draft_tokens"] / steps, "drafts_per_step": m["drafts"] / steps}
    base = out["plain"]["ms_per_step"]
    for row in out.values():
        row["over_plain"] = row["ms_per_step"] / base
    return out


def compare(cell: dict, costs: dict[str, dict[str, float]], method: str, against: str) -> dict[str, float | None]:
    """``method`` against ``against``: its step over the other's, plain steps per extra draft token a step (None
    when both verify as many), and tok/s wave by wave (geometric mean, 95% interval)."""
    a, b = costs[method], costs[against]
    extra = a["draft_tokens_per_step"] - b["draft_tokens_per_step"]
    waves = [x / y for x, y in zip(cell["methods"][method]["speedup_waves"], cell["methods"][against]["speedup_waves"])]
    mean, low, high = ratio_interval(waves)
    return {"step_ratio": a["ms_per_step"] / b["ms_per_step"],
            "cost_per_extra_token": (a["over_plain"] - b["over_plain"]) / extra if abs(extra) > 1e-9 else None,
            "tok_s_ratio": mean, "ci95": [low, high]}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--method", default="lookahead")
    parser.add_argument("--against", default="suffix")
    args = parser.parse_args(argv)
    out = {}
    for path in args.files:
        cells = [c for c in json.loads(path.read_text())["cells"] if c["concurrency"] == 1]
        if not cells:
            raise SystemExit(f"{path}: no cell at concurrency 1 (steps are apart only there)")
        for i, cell in enumerate(cells):
            methods = cell["methods"]
            if any("ttft_s" not in m.get("per_request", {}) for m in methods.values()):
                raise SystemExit(f"{path}: keeps no latency and TTFT per request "
                                 "(written before bench_serve.py kept them)")
            missing = {"plain", args.method, args.against} - set(methods)
            if missing:
                raise SystemExit(f"{path}: no {', '.join(sorted(missing))} (methods: {', '.join(methods)})")
            costs = step_costs(cell)
            versus = compare(cell, costs, args.method, args.against)
            key = f"{path.name}:{cell['dataset']}" + (f":{i}" if len(cells) > 1 else "")
            out[key] = {"methods": costs, "versus": versus}
            print(f"{key}: plain {costs['plain']['ms_per_step']:.1f} ms a step")
            for name, row in costs.items():
                print(f"  {name:18s} {row['steps']:6.0f} steps, {row['ms_per_step']:6.1f} ms ({row['over_plain']:.3f}x "
                      f"plain's), {row['draft_tokens_per_step']:.2f} draft tokens a step")
            per_token = versus["cost_per_extra_token"]
            low, high = versus["ci95"]
            interval = "" if low is None else f" ({low:.3f}-{high:.3f})"
            print(f"  {args.method} over {args.against}: steps {versus['step_ratio']:.3f}x as long"
                  + ("" if per_token is None else f", {per_token:.3f} plain steps per extra draft token")
                  + f"; tok/s wave by wave {versus['tok_s_ratio']:.3f}x{interval}")
    return out


if __name__ == "__main__":
    main()
