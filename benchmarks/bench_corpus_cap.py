"""The draft index's corpus cap under a stream of finished requests.

A running batch of ``--batch`` requests over real text (the docqa documents,
bundled tokenizer; ``--prompt-tokens`` each, at random offsets) gains
``--tokens-per-step`` tokens a step through the drafter's batch calls (sync,
then drafting every row); a request that has generated ``--output-tokens``
finishes and a new one takes its row, until ``--requests`` have finished.
Its outputs fill the corpus of the index and its back-off until
``index_corpus_bytes`` (``--cap-mib``) evicts the oldest.

Reported every ``--report-every`` finished requests: the corpus's charge
(both indexes; what the cap bounds), the drafter's memory estimate
(``memory_bytes``: capacities held, the running requests' texts included),
the finished output tokens still held, and the process's resident memory;
and over the whole run the milliseconds per step (median, p99, max), which
include any eviction the upkeep runs inline (``--upkeep inline``) or wait
for it on its thread (``thread``). Exits 1 if the charge ever ends a step
over the cap.

Example::

    python benchmarks/bench_corpus_cap.py --cap-mib 16 --requests 3000 \\
        --out benchmarks/results/corpus_cap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"


def rss_mib() -> float:
    """The process's resident memory now (not its peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def run(args: argparse.Namespace, text: np.ndarray) -> dict[str, Any]:
    from lookahead_vllm.core.config import resolve
    from lookahead_vllm.core.drafter import Drafter

    config = resolve({"index_corpus_bytes": args.cap_mib << 20,
                      "_profile": {"upkeep_thread": args.upkeep == "thread"}}, platform="gpu")
    drafter = Drafter(config)
    indexes = [ix for ix in (drafter.index, drafter.backoff) if ix is not None]
    batch, plen, olen = args.batch, args.prompt_tokens, args.output_tokens
    width = plen + olen + args.tokens_per_step
    rng = np.random.default_rng(args.seed)
    table = np.zeros((batch, width), np.int32)
    slots = np.arange(batch, dtype=np.int64)
    num = np.full(batch, plen, np.int64)

    def admit(row: int, slot: int) -> None:
        start = int(rng.integers(0, len(text) - width))
        table[row] = text[start:start + width]
        slots[row], num[row] = slot, plen

    for row in range(batch):
        admit(row, row)
    next_slot, finished, rows_out, times = batch, 0, [], []
    rows = np.arange(batch, dtype=np.int64)
    prompts = np.full(batch, plen, np.int64)
    budgets = np.full(batch, 16, np.int64)
    rss_start = rss_mib()
    while finished < args.requests:
        start = time.perf_counter()
        drafter.sync(slots, rows, table, num, prompts)
        drafter.draft_rows(slots, budgets, config.profile.min_draft_confidence, False)
        times.append(time.perf_counter() - start)
        num += args.tokens_per_step
        for row in np.flatnonzero(num >= plen + olen).tolist():
            drafter.finish(int(slots[row]))
            finished += 1
            admit(row, next_slot)
            next_slot += 1
            if finished % args.report_every == 0:
                charge = sum(ix.corpus_bytes() for ix in indexes)  # settles: after the step's upkeep
                rows_out.append({
                    "finished": finished, "corpus_charge_bytes": charge,
                    "corpus_tokens": [ix.corpus_tokens() for ix in indexes],
                    "drafter_bytes": drafter.memory_bytes(), "rss_mib": rss_mib(),
                })
                last = rows_out[-1]
                print(f"{finished:6d} finished: charge {charge / 2**20:6.2f} MiB of {args.cap_mib}, drafter "
                      f"{last['drafter_bytes'] / 2**20:6.2f} MiB, held tokens {last['corpus_tokens']}, "
                      f"RSS {last['rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
                if charge > args.cap_mib << 20:
                    print(f"corpus charge {charge} over the cap {args.cap_mib << 20}", file=sys.stderr)
                    return {"rows": rows_out, "over_cap": True}
    ordered = sorted(times)
    return {
        "rows": rows_out, "over_cap": False, "steps": len(times),
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_p99": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "step_ms_max": 1e3 * ordered[-1],
        "rss_start_mib": rss_start, "rss_end_mib": rss_mib(),
    }


def plot(result: dict[str, Any], cap_mib: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["finished"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["corpus_charge_bytes"] / 2**20 for r in rows], "o-", label="corpus charge (both indexes)")
    ax.plot(x, [r["drafter_bytes"] / 2**20 for r in rows], "x--", label="drafter memory_bytes (running texts too)")
    ax.axhline(cap_mib, color="grey", ls=":", label="index_corpus_bytes")
    ax.set_xlabel("finished requests")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-mib", type=int, default=16, help="index_corpus_bytes, in MiB")
    p.add_argument("--requests", type=int, default=3000, help="finished requests to stream through")
    p.add_argument("--batch", type=int, default=64, help="running requests")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=512)
    p.add_argument("--tokens-per-step", type=int, default=16, help="tokens each request commits a step")
    p.add_argument("--upkeep", choices=["inline", "thread"], default="thread")
    p.add_argument("--report-every", type=int, default=200, help="finished requests between reports")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (and a PNG beside it)")
    args = p.parse_args(argv)
    for flag in ("cap_mib", "requests", "batch", "prompt_tokens", "output_tokens", "tokens_per_step",
                 "report_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    from bench_proposer_scale import corpus_tokens

    text = corpus_tokens(4 * (args.prompt_tokens + args.output_tokens + args.tokens_per_step))
    result = run(args, text)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, **result}
    if "steps" in result:
        print(f"steps {result['steps']}: {result['step_ms_median']:.3f} ms median, {result['step_ms_p99']:.3f} "
              f"p99, {result['step_ms_max']:.3f} max; RSS {result['rss_start_mib']:.0f} -> "
              f"{result['rss_end_mib']:.0f} MiB", file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        plot(report, args.cap_mib, args.out.with_suffix(".png"))
    if result["over_cap"]:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
