"""Pre-drafting outlook: how often a draft prepared during the forward would be the right one.

Branch prediction for speculative decoding (Duan et al., 2024) starts the
next round of drafting before verification ends, from a predicted acceptance.
For a drafter that copies earlier text, the next step's draft is a function of
the request's text after the step, so a draft prepared while the forward runs
is the right one only if the step's outcome was predicted exactly: how many
draft tokens are accepted *and* which bonus token follows. The only outcome
the index can name in full is "the whole draft accepted, then the token the
index expects next" (a rejection's bonus token is by definition not the
drafted one, and nothing says which it is).

This script replays lookahead's defaults (``sim_acceptance.simulate``: chains
from the draft index, cut by the forward-cost model as the proposer cuts
them) on cached greedy outputs and reports per workload, platform prices and
batch size:

  whole   the share of steps that accepted their whole draft (an empty draft
          included: its bonus token is the whole outcome);
  hit     the share of steps whose outcome was that prediction: the steps a
          pre-drafted next draft would have served. At most this share of the
          drafting work could leave the critical path; every other step
          drafts again after the forward, as now.

Example (outputs cached by ``sim_acceptance.py``)::

    python benchmarks/predraft_outlook.py --datasets humaneval codeedit mtbench chat docqa agent \\
        --platforms cpu gpu --batch 1 8 --out benchmarks/results/predraft_outlook_dev.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim_acceptance import simulate
from workloads import check_positive, save_rows, workload_parser, workloads



def outlook(result: dict[str, Any]) -> dict[str, float]:
    """``whole`` and ``hit`` shares of a ``simulate`` result's steps."""
    steps = max(result["steps"], 1)
    return {"whole": result["whole_draft_steps"] / steps, "hit": result["predraft_hit_steps"] / steps}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Hit share per workload, one bar per (platform, batch) cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    cells = list(dict.fromkeys((r["platform"], r["batch"]) for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(cells), 1)
    for j, (platform, batch) in enumerate(cells):
        values = [next((r["hit"] for r in rows if r["dataset"] == ds and (r["platform"], r["batch"]) == (platform, batch)),
                       0.0) for ds in datasets]
        ax.bar([i + j * width for i in range(len(datasets))], values, width, label=f"{platform.upper()} prices, batch {batch}")
    ax.set_xticks([i + width * (len(cells) - 1) / 2 for i in range(len(datasets))], datasets, fontsize=8)
    ax.set_ylabel("share of steps a pre-drafted draft serves")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.suptitle("pre-drafting for the outcome 'whole draft accepted, then the index's next token'", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = workload_parser(__doc__)
    p.add_argument("--platforms", nargs="+", choices=("cpu", "gpu"), default=["cpu", "gpu"],
                   help="token prices the drafts are cut with (sim_acceptance.py --platform)")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8], help="requests stepping together")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON (and a PNG beside it)")
    args = p.parse_args(argv)
    check_positive(p, num_prompts=args.num_prompts, max_tokens=args.max_tokens, batch=args.batch)
    rows = []
    for ds, prompts, outputs in workloads(args):
        for platform in args.platforms:
            for batch in args.batch:
                r = simulate({}, prompts, outputs, [], batch=batch, platform=platform)
                row = {"dataset": ds, "split": args.split, "platform": platform, "batch": batch,
                       "steps": r["steps"], "mal": r["mal"], "whole_draft_steps": r["whole_draft_steps"],
                       "predraft_hit_steps": r["predraft_hit_steps"], **outlook(r)}
                rows.append(row)
                print(f"{ds:10s} {platform} bs{batch:<3d} steps {r['steps']:5d}  whole {row['whole']:.2f}  "
                      f"hit {row['hit']:.2f}", flush=True)
    save_rows(args, rows, plot)
    return rows


if __name__ == "__main__":
    main()
