"""Drafting-core cost at serving scale: the native DraftIndex next to the
pure-Python reference.

Each scenario runs B sequences with P-token prompts (windows of real text:
the Python reference documentation shipped with the interpreter,
``pydoc_data.topics``, as whitespace-split words or bytes; fixed per Python
version),
after a warm corpus of finished outputs. Admission: one ``sync`` per new
prompt. Then every step each sequence commits 2 tokens (the text's own
continuation) and one ``sync`` + ``draft_batch`` call covers the batch, as the
proposer does per engine step. Reports ms per step (median, p99, max), ms per
admitted prompt, ``memory_bytes()`` and the process RSS; each (core, scenario)
runs in a fresh process so RSS is its own.

    python benchmarks/bench_drafter_scale.py          # JSON + PNG to benchmarks/results/drafter_scale.*
    python benchmarks/bench_drafter_scale.py --batches 64 --prompts 512 --steps 50 --ref-steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
COMMIT_PER_STEP = 2
WARM_SEQUENCES, WARM_OUTPUT = 64, 512


def text_tokens(kind: str) -> np.ndarray:
    """Python's reference documentation as token ids (words: ids in order of first appearance)."""
    from pydoc_data.topics import topics

    raw = "\n".join(topics[k] for k in sorted(topics)).encode()
    if kind == "bytes":
        return np.frombuffer(raw, np.uint8).astype(np.int32)
    vocab: dict[bytes, int] = {}
    return np.array([vocab.setdefault(w, len(vocab)) for w in raw.split()], np.int32)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_index(core: str):
    from lookahead_lab.reference.draft_index import DraftIndex
    from lookahead_vllm.core.config import resolve
    from lookahead_vllm.core.native import make_draft_index

    config = resolve().index_config()
    return make_draft_index(config) if core == "native" else DraftIndex(config)


def warm_corpus(index, text: np.ndarray, rng: np.random.Generator) -> None:
    """Finished outputs in the corpus before the measured sequences arrive."""
    for i in range(WARM_SEQUENCES):
        start = int(rng.integers(0, len(text) - WARM_OUTPUT - 64))
        index.add(-1 - i, text[start:start + WARM_OUTPUT + 64].tolist(), 64)
        index.finish(-1 - i)


def run(core: str, batch: int, prompt: int, steps: int, budget: int, tree: bool, tokens: str) -> dict:
    """One scenario in this process: admission, then `steps` timed steps."""
    text = text_tokens(tokens)
    rng = np.random.default_rng(0)
    index = make_index(core)
    rss_before = rss_mb()
    warm_corpus(index, text, rng)
    width = prompt + COMMIT_PER_STEP * steps
    starts = rng.integers(0, len(text) - width, batch)
    table = np.stack([text[s:s + width] for s in starts]).astype(np.int32)  # [batch, width]
    sids, rows = np.arange(batch, dtype=np.int64), np.arange(batch, dtype=np.int64)
    prompt_lens = np.full(batch, prompt, np.int64)
    admit_ms = []
    for i in range(batch):
        t0 = time.perf_counter()
        index.sync(sids[i:i + 1], rows[i:i + 1], table, prompt_lens[i:i + 1], prompt_lens[i:i + 1])
        admit_ms.append((time.perf_counter() - t0) * 1e3)
    budgets = np.full(batch, budget, np.int64)
    step_ms, drafted = [], 0
    for step in range(1, steps + 1):
        num_tokens = prompt_lens + COMMIT_PER_STEP * step
        t0 = time.perf_counter()
        index.sync(sids, rows, table, num_tokens, prompt_lens)
        out = index.draft_batch(sids, budgets, 0.0, tree)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        drafted += int(out[3].sum())
    step_sorted = sorted(step_ms)
    return {
        "core": core, "batch": batch, "prompt": prompt, "steps": steps, "budget": budget, "tree": tree,
        "tokens": tokens, "text_tokens": len(text),
        "step_ms": {"median": statistics.median(step_ms), "p99": step_sorted[min(len(step_sorted) - 1,
                                                                                   int(0.99 * len(step_sorted)))],
                    "max": step_sorted[-1], "mean": statistics.fmean(step_ms)},
        "admit_ms": {"median": statistics.median(admit_ms), "max": max(admit_ms)},
        "drafted_per_seq_step": drafted / (batch * steps),
        "memory_bytes": index.memory_bytes() if hasattr(index, "memory_bytes") else None,
        "rss_mb": rss_mb(), "rss_delta_mb": rss_mb() - rss_before,
    }


def run_isolated(args, core: str, batch: int, prompt: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", core, str(batch), str(prompt), str(steps), "--budget",
           str(args.budget), "--tokens", args.tokens] + (["--tree"] if args.tree else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({(r["batch"], r["prompt"]) for r in rows})
    labels = [f"B={b}\nP={p}" for b, p in scenarios]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(scenarios))
    for k, core in enumerate(("native", "reference")):
        by = {(r["batch"], r["prompt"]): r for r in rows if r["core"] == core}
        med = [by[s]["step_ms"]["median"] if s in by else np.nan for s in scenarios]
        p99 = [by[s]["step_ms"]["p99"] if s in by else np.nan for s in scenarios]
        adm = [by[s]["admit_ms"]["median"] if s in by else np.nan for s in scenarios]
        axes[0].bar(x + (k - 0.5) * 0.4, med, 0.4, label=f"{core} median")
        axes[0].scatter(x + (k - 0.5) * 0.4, p99, marker="_", s=200, color="k", label="p99" if k == 0 else None)
        axes[1].bar(x + (k - 0.5) * 0.4, adm, 0.4, label=core)
    axes[0].axhline(1.0, ls="--", color="grey", lw=1)
    axes[0].set(yscale="log", ylabel="ms per step (sync + draft_batch)", title="step, 2 tokens/sequence")
    axes[1].axhline(1.0, ls="--", color="grey", lw=1)
    axes[1].set(yscale="log", ylabel="ms per admitted prompt", title="admission (sync of a new prompt)")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--steps", type=int, default=200, help="timed steps of the native core")
    p.add_argument("--ref-steps", type=int, default=10, help="timed steps of the reference (0: skip it)")
    p.add_argument("--budget", type=int, default=8, help="draft budget per sequence")
    p.add_argument("--tree", action="store_true", help="draft trees (default: chains)")
    p.add_argument("--tokens", choices=["words", "bytes"], default="words")
    p.add_argument("--out", type=Path, default=RESULTS / "drafter_scale.json")
    p.add_argument("--worker", nargs=4, metavar=("CORE", "BATCH", "PROMPT", "STEPS"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        core, batch, prompt, steps = args.worker[0], *map(int, args.worker[1:])
        print(json.dumps(run(core, batch, prompt, steps, args.budget, args.tree, args.tokens)))
        return
    rows = []
    for batch in args.batches:
        for prompt in args.prompts:
            for core, steps in (("native", args.steps), ("reference", args.ref_steps)):
                if steps <= 0:
                    continue
                r = run_isolated(args, core, batch, prompt, steps)
                rows.append(r)
                s = r["step_ms"]
                print(f"{core:9s} B={batch:4d} P={prompt:5d}: step median {s['median']:8.3f} ms  p99 {s['p99']:8.3f}"
                      f"  max {s['max']:8.3f}  admit {r['admit_ms']['median']:7.3f} ms/prompt"
                      f"  memory {(r['memory_bytes'] or 0) / 2**20:7.1f} MiB  rss {r['rss_mb']:7.1f} MiB"
                      f"  drafted {r['drafted_per_seq_step']:.2f}/seq-step", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "commit_per_step": COMMIT_PER_STEP, "warm_corpus": [WARM_SEQUENCES, WARM_OUTPUT],
            "python": platform.python_version(), "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
