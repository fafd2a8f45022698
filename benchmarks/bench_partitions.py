"""Drafter cost per step with tenant partitions (config ``draft_sharing``).

256 running requests with 2k-token prompts (windows of real text: Python's
reference documentation, whitespace-split words) spread round-robin over 1,
16 or 256 partitions, after a warm corpus of finished outputs spread the same
way. Every step each request commits 2 tokens and one ``Drafter.sync`` plus
one ``Drafter.draft_rows`` cover the batch, as the proposer
does per engine step (the native index, its back-off included). The
partition counts are measured interleaved, round by round, so machine noise
falls on all of them alike. Reports ms per step (median, p90) and the ratio
to one partition (the shared default).

    python benchmarks/bench_partitions.py        # JSON + PNG: benchmarks/results/partitions_drafter.*
    python benchmarks/bench_partitions.py --steps 20 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
COMMIT_PER_STEP = 2
WARM_SEQUENCES, WARM_OUTPUT = 256, 512


def text_tokens() -> np.ndarray:
    from pydoc_data.topics import topics

    raw = "\n".join(topics[k] for k in sorted(topics)).encode()
    vocab: dict[bytes, int] = {}
    return np.array([vocab.setdefault(w, len(vocab)) for w in raw.split()], np.int32)


class Cell:
    """One partition count: a Drafter with its warm corpus and running batch."""

    def __init__(self, partitions: int, batch: int, prompt: int, steps: int, text: np.ndarray) -> None:
        from lookahead_vllm.core.config import resolve
        from lookahead_vllm.core.drafter import Drafter

        self.partitions = partitions
        self.drafter = Drafter(resolve())
        salts = [f"tenant-{p}" for p in range(partitions)]
        rng = np.random.default_rng(0)
        for i in range(WARM_SEQUENCES):  # finished outputs of every tenant
            at = int(rng.integers(len(text) - WARM_OUTPUT))
            part = self.drafter.partition(salts[i % partitions])
            for index in self.drafter._indexes():
                index.add(-1 - i, text[at:at + WARM_OUTPUT].tolist(), 0, partition=part)
                index.finish(-1 - i)
        width = prompt + COMMIT_PER_STEP * (steps + 1)
        self.table = np.zeros((batch, width), np.int32)
        for r in range(batch):
            at = int(rng.integers(len(text) - width))
            self.table[r] = text[at:at + width]
        self.slots = np.arange(batch, dtype=np.int64)
        self.rows = np.arange(batch, dtype=np.int64)
        self.prompt_lens = np.full(batch, prompt, np.int64)
        self.parts = np.array([self.drafter.partition(salts[r % partitions]) for r in range(batch)], np.int64)
        self.num = np.full(batch, prompt, np.int64)
        self.drafter.sync(self.slots, self.rows, self.table, self.num, self.prompt_lens, self.parts)
        self.budgets = np.full(batch, 16, np.int64)

    def step(self) -> float:
        self.num += COMMIT_PER_STEP
        start = time.perf_counter()
        self.drafter.sync(self.slots, self.rows, self.table, self.num, self.prompt_lens, self.parts)
        self.drafter.draft_rows(self.slots, self.budgets, 0.0, False)
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per round and partition count")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "partitions_drafter"))
    args = ap.parse_args()
    text = text_tokens()
    total = args.steps * args.rounds
    cells = {p: Cell(p, args.batch, args.prompt, total + 2, text) for p in args.partitions}
    for cell in cells.values():  # one untimed step each
        cell.step()
    times: dict[int, list[float]] = {p: [] for p in cells}
    for _ in range(args.rounds):
        for p, cell in cells.items():
            times[p] += [cell.step() for _ in range(args.steps)]
    base = statistics.median(times[args.partitions[0]])
    rows = []
    for p in args.partitions:
        ms = sorted(t * 1e3 for t in times[p])
        count, charge = cells[p].drafter.partition_stats()
        rows.append({"partitions": p, "partitions_held": count, "corpus_bytes": charge,
                     "ms_per_step_median": statistics.median(ms), "ms_per_step_p90": ms[int(0.9 * (len(ms) - 1))],
                     "ratio_to_shared": statistics.median(ms) / (base * 1e3)})
        print(f"{p:4d} partitions: {rows[-1]['ms_per_step_median']:.3f} ms/step median, "
              f"p90 {rows[-1]['ms_per_step_p90']:.3f}, x{rows[-1]['ratio_to_shared']:.3f} of shared")
    result = {"benchmark": "bench_partitions", "batch": args.batch, "prompt_tokens": args.prompt,
              "steps": args.steps, "rounds": args.rounds, "warm_sequences": WARM_SEQUENCES,
              "machine": platform.machine(), "python": platform.python_version(), "cells": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"), args)


def plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    labels = [str(r["partitions"]) for r in rows]
    ax.bar(labels, [r["ms_per_step_median"] for r in rows], color="#4477aa")
    for i, r in enumerate(rows):
        ax.text(i, r["ms_per_step_median"], f"x{r['ratio_to_shared']:.2f}", ha="center", va="bottom")
    ax.set_xlabel("partitions (tenants)")
    ax.set_ylabel("drafter ms / step (median)")
    ax.set_title(f"Drafter cost, {args.batch} requests x {args.prompt}-token prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
