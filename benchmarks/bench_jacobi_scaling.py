"""Jacobi lookahead scaling (seed 001 Fig. 6 style): decoding steps vs tokens per step.

For every (N, W) pair, one engine with ``source="jacobi"`` and G = W
generates the same greedy prompts at batch 1; the plot shows how many
decoding steps it took against the tokens each step scores,
(W + G)(N - 1), one line per N, with plain decoding's steps as the reference.
Outputs are checked token for token against plain vLLM.

    python benchmarks/bench_jacobi_scaling.py --ngram 3 5 7 --window 4 8 16 --num-prompts 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lookahead_vllm.vllm.offline import apply_cpu_env

apply_cpu_env(VLLM_LOGGING_LEVEL="WARNING")

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def step_slots(n: int, w: int) -> int:
    """Draft slots of a full Jacobi step with G = W: (W + G)(N - 1) - 1."""
    from lookahead_vllm.core.config import LookaheadConfig

    return LookaheadConfig(source="jacobi", jacobi_window=w, jacobi_ngram=n, jacobi_guesses=w).jacobi_step_slots


def run_config(model: str, prompts: list[str], max_tokens: int, n: int, w: int) -> dict:
    from vllm import LLM, SamplingParams

    from lookahead_vllm.vllm.offline import engine_kwargs, generate, shutdown_engine
    from lookahead_vllm.vllm.proposer import find_proposers

    g = w
    # Cost model off: every step carries the window, whatever it costs here.
    config = {"source": "jacobi", "draft_shape": "hier", "jacobi_window": w, "jacobi_ngram": n,
              "jacobi_guesses": g, "decoding_length": g * (n - 1), "cost_free_tokens": 0}
    scored = step_slots(n, w) + 1  # the root too
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
    return {"ngram": n, "window": w, "guesses": g, "tokens_per_step_scored": scored, "tokens": tokens,
            "decoding_steps": steps, "step_compression": tokens / steps, "seconds": seconds,
            "pool_accepted_tokens": stats["pool_accepted_tokens"], "ids": out.token_ids}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ngram", type=int, nargs="+", default=[3, 5, 7])
    p.add_argument("--window", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--out", type=Path, default=RESULTS / "jacobi_scaling.json")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from lookahead_vllm.datasets import load_prompts
    from lookahead_vllm.models import prepare_smollm2
    from lookahead_vllm.vllm.offline import count_mismatches, engine_kwargs, generate, shutdown_engine

    model = str(prepare_smollm2())
    prompts = load_prompts(args.dataset, AutoTokenizer.from_pretrained(model), args.num_prompts)
    plain = LLM(model=model, **engine_kwargs("plain"))
    ref = generate(plain, prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), 1)
    shutdown_engine(plain)
    plain_tokens = sum(len(t) for t in ref.token_ids)
    rows = []
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    skipped = []
    for n in args.ngram:
        for w in args.window:
            if step_slots(n, w) > MAX_SPEC_LEN:
                skipped.append({"ngram": n, "window": w, "why": f"(W + G)(N - 1) - 1 > vLLM's MAX_SPEC_LEN={MAX_SPEC_LEN}"})
                log(f"N={n} W={w}: skipped, {skipped[-1]['why']}")
                continue
            row = run_config(model, prompts, args.max_tokens, n, w)
            row["mismatches"] = count_mismatches(ref.token_ids, row.pop("ids"))
            rows.append(row)
            log(f"N={n} W={w} G={w}: {row['tokens_per_step_scored']} tokens/step, {row['decoding_steps']} steps "
                f"(plain {plain_tokens}), compression {row['step_compression']:.3f}, "
                f"mismatches {row['mismatches']}, {row['seconds']:.1f} s")
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "plain_steps": plain_tokens, "rows": rows,
              "skipped": skipped}
    args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))
    log(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r["ngram"] for r in report["rows"]}):
        pts = sorted((r["tokens_per_step_scored"], r["decoding_steps"], r["window"]) for r in report["rows"] if r["ngram"] == n)
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", label=f"N={n}")
        for x, y, w in pts:
            ax.annotate(f"W={w}", (x, y), fontsize=7)
    ax.axhline(report["plain_steps"], color="gray", linestyle="--", label="plain (1 token/step)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens scored per step, (W + G)(N - 1), G = W")
    ax.set_ylabel("decoding steps")
    ax.set_title("Jacobi lookahead scaling (SmolLM2-135M, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
