"""Jacobi lookahead scaling (seed 001 Fig. 6 style): decoding steps vs tokens per step.

For every (N, W) pair, one engine generates the same greedy prompts at batch 1
with the window on every step (cost model off); the plot shows how many
decoding steps it took against the tokens each step scores, (W + G)(N - 1),
one line per N, with plain decoding's steps as the reference. G = W, or the
largest G that keeps a step within vLLM's MAX_SPEC_LEN draft slots (the row
records it). Outputs are checked token for token against plain vLLM.

``--source jacobi`` (default) measures the pool alone. ``--source both``
measures the window's ceiling on top of the trie: for every verify budget
G(N - 1) in the grid it also runs ``source="trie"`` (``hier``, same budget,
cost model off) and reports ``vs_trie``, the trie's decoding steps over
``both``'s. On a platform where the step's tokens were free, that ratio is
``both``'s speedup over the trie; the CPU seconds are recorded beside it.

    python benchmarks/bench_jacobi_scaling.py --ngram 3 5 7 --window 4 8 16 --num-prompts 4
    python benchmarks/bench_jacobi_scaling.py --source both --dataset mtbench --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lookahead_lab.offline import apply_cpu_env

apply_cpu_env(VLLM_LOGGING_LEVEL="WARNING")

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def step_slots(n: int, w: int, g: int) -> int:
    """Draft slots of a full Jacobi step: (W + G)(N - 1) - 1."""
    from lookahead_vllm.core.config import Profile

    return Profile.for_platform("cpu", {"jacobi_window": w, "jacobi_ngram": n, "jacobi_guesses": g}).jacobi_step_slots


def guesses_that_fit(n: int, w: int, max_slots: int) -> int:
    """G = W, or the largest G < W whose step fits in ``max_slots`` draft slots; 0 if none does."""
    for g in range(w, 0, -1):
        if step_slots(n, w, g) <= max_slots:
            return g
    return 0


def window_config(source: str, n: int, w: int, g: int) -> dict:
    """Engine config of one grid cell: the window on every step (cost model
    off), verify budget G(N - 1)."""
    return {"source": source, "draft_shape": "hier", "decoding_length": g * (n - 1), "cost_free_tokens": 0,
            "_profile": {"jacobi_window": w, "jacobi_ngram": n, "jacobi_guesses": g}}


def trie_config(budget: int) -> dict:
    """The trie alone at a cell's verify budget: same shape, no window, cost model off."""
    return {"source": "trie", "draft_shape": "hier", "decoding_length": budget, "cost_free_tokens": 0}


def run_config(model: str, prompts: list[str], max_tokens: int, config: dict) -> dict:
    from vllm import LLM, SamplingParams

    from lookahead_lab.offline import engine_kwargs, find_proposers, generate, shutdown_engine
    from lookahead_vllm.core.config import resolve

    resolved = resolve(config)
    # Verify nodes, window nodes and the root: (W + G)(N - 1) with a window.
    scored = resolved.decoding_length + resolved.lookahead_nodes + 1
    llm = LLM(model=model, **engine_kwargs("lookahead", k=scored - 1, lookahead=config))
    (proposer,) = find_proposers(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    out = generate(llm, prompts, params, 1)
    seconds = time.perf_counter() - start
    stats = proposer.stats.as_dict()
    shutdown_engine(llm)
    tokens = sum(len(t) for t in out.token_ids)
    # Decode steps: each prompt's first token comes from its prefill step.
    steps = stats["steps"] + len(prompts)
    return {"source": resolved.source, "decoding_length": resolved.decoding_length,
            "tokens_per_step_scored": scored,
            "tokens": tokens, "decoding_steps": steps, "step_compression": tokens / steps, "seconds": seconds,
            "pool_accepted_tokens": stats["pool_accepted_tokens"], "ids": out.token_ids}


def grid(ngrams: list[int], windows: list[int], max_slots: int) -> tuple[list[tuple[int, int, int]], list[dict]]:
    """(N, W, G) cells to run, and the cells no G fits (with why)."""
    cells, skipped = [], []
    for n in ngrams:
        for w in windows:
            g = guesses_that_fit(n, w, max_slots)
            if g:
                cells.append((n, w, g))
            else:
                skipped.append({"ngram": n, "window": w, "why": f"(W + 1)(N - 1) - 1 > vLLM's MAX_SPEC_LEN={max_slots}"})
    return cells, skipped


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: bundled SmolLM2-135M-Instruct fp32)")
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--source", choices=["jacobi", "both"], default="jacobi")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ngram", type=int, nargs="+", default=[3, 5, 7])
    p.add_argument("--window", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/jacobi_scaling.json (jacobi), results/jacobi_ceiling_<dataset>.json (both)")
    args = p.parse_args(argv)
    for flag, value, low in (("--num-prompts", args.num_prompts, 1), ("--max-tokens", args.max_tokens, 1),
                             ("--ngram", min(args.ngram), 2), ("--window", min(args.window), 1)):
        if value < low:
            p.error(f"{flag} {value}: must be at least {low}")
    if args.out is None:
        name = "jacobi_scaling.json" if args.source == "jacobi" else f"jacobi_ceiling_{args.dataset}.json"
        args.out = RESULTS / name
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    from lookahead_lab.datasets import load_prompts
    from lookahead_lab.offline import count_mismatches, engine_kwargs, generate, shutdown_engine
    from lookahead_vllm.models import prepare_smollm2

    model = str(args.model or prepare_smollm2())
    prompts = load_prompts(args.dataset, AutoTokenizer.from_pretrained(model), args.num_prompts)
    plain = LLM(model=model, **engine_kwargs("plain"))
    start = time.perf_counter()
    ref = generate(plain, prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), 1)
    plain_seconds = time.perf_counter() - start
    shutdown_engine(plain)
    plain_tokens = sum(len(t) for t in ref.token_ids)
    cells, skipped = grid(args.ngram, args.window, MAX_SPEC_LEN)
    for s in skipped:
        log(f"N={s['ngram']} W={s['window']}: skipped, {s['why']}")

    def run(config: dict, what: str) -> dict:
        row = run_config(model, prompts, args.max_tokens, config)
        row["mismatches"] = count_mismatches(ref.token_ids, row.pop("ids"))
        log(f"{what}: {row['tokens_per_step_scored']} tokens/step, {row['decoding_steps']} steps "
            f"(plain {plain_tokens}), compression {row['step_compression']:.3f}, pool tokens "
            f"{row['pool_accepted_tokens']}, mismatches {row['mismatches']}, {row['seconds']:.1f} s")
        return row

    trie_rows: dict[int, dict] = {}
    if args.source == "both":
        for budget in sorted({g * (n - 1) for n, _, g in cells}):
            trie_rows[budget] = run(trie_config(budget), f"trie budget {budget}")
    rows = []
    for n, w, g in cells:
        row = {"ngram": n, "window": w, "guesses": g,
               **run(window_config(args.source, n, w, g), f"{args.source} N={n} W={w} G={g}")}
        trie = trie_rows.get(row["decoding_length"])
        if trie is not None:
            row["trie_steps"], row["trie_seconds"] = trie["decoding_steps"], trie["seconds"]
            row["vs_trie"] = trie["decoding_steps"] / row["decoding_steps"]
            row["vs_trie_seconds"] = trie["seconds"] / row["seconds"]
            log(f"  vs trie at budget {row['decoding_length']}: {row['vs_trie']:.3f}x fewer steps, "
                f"{row['vs_trie_seconds']:.3f}x the speed on this CPU")
        rows.append(row)
        write(args, plain_tokens, plain_seconds, rows, list(trie_rows.values()), skipped)
    log(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def write(args, plain_steps: int, plain_seconds: float, rows: list[dict], trie_rows: list[dict],
          skipped: list[dict]) -> None:
    """JSON and plot after every cell, so a crash loses no finished cell."""
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "plain_steps": plain_steps,
              "plain_seconds": plain_seconds, "rows": rows, "trie_rows": trie_rows, "skipped": skipped}
    args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    """Decoding steps vs tokens scored per step; with a trie reference, a
    second panel: ``both`` over the trie in steps and in CPU seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    source = rows[0].get("source", "jacobi") if rows else "jacobi"
    trie = sorted((r["tokens_per_step_scored"], r["decoding_steps"]) for r in report.get("trie_rows", []))
    fig, axes = plt.subplots(1, 2 if trie else 1, figsize=(11 if trie else 6.5, 4.2), squeeze=False)
    ax = axes[0][0]
    for n in sorted({r["ngram"] for r in rows}):
        pts = sorted((r["tokens_per_step_scored"], r["decoding_steps"], r["window"], r["guesses"])
                     for r in rows if r["ngram"] == n)
        ax.plot([x for x, *_ in pts], [y for _, y, *_ in pts], marker="o", label=f"{source}, N={n}")
        for x, y, w, g in pts:
            ax.annotate(f"W={w}" + (f",G={g}" if g != w else ""), (x, y), fontsize=7)
    if trie:
        ax.plot([x for x, _ in trie], [y for _, y in trie], marker="s", color="black",
                label="trie alone (hier), budget G(N - 1)")
    ax.axhline(report["plain_steps"], color="gray", linestyle="--", label="plain (1 token/step)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens scored per step, (W + G)(N - 1); G = W where it fits")
    ax.set_ylabel("decoding steps")
    ax.set_title(f"Jacobi scaling, {report['args'].get('dataset', '')} (SmolLM2-135M, window every step)", fontsize=9)
    ax.legend(fontsize=7)
    if trie:
        _plot_vs_trie(axes[0][1], rows)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_vs_trie(ax, rows: list[dict]) -> None:
    """``both`` over the trie at the same verify budget: fewer steps (what a
    platform with free tokens gains) and CPU speed (what this machine gains)."""
    pts = sorted((r["tokens_per_step_scored"], r["vs_trie"], r["vs_trie_seconds"], r["ngram"], r["window"])
                 for r in rows)
    xs = [p[0] for p in pts]
    ax.scatter(xs, [p[1] for p in pts], marker="o", label="trie steps / both steps")
    ax.scatter(xs, [p[2] for p in pts], marker="x", color="red", label="both speed / trie speed, this CPU")
    for x, y, _, n, w in pts:
        ax.annotate(f"N={n},W={w}", (x, y), fontsize=6)
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.axhline(1.15, color="green", linestyle=":", label="issue target 1.15x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens scored per step by both")
    ax.set_ylabel("both / trie alone")
    ax.set_title("both over the trie at the same verify budget", fontsize=9)
    ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
