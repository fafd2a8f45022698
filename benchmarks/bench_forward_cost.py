"""Forward cost vs tokens scored per step, inside vLLM, on this machine.

A decode step that verifies ``n`` draft tokens scores ``n + 1`` tokens. This
measures the median step time of one request (fixed context) for each ``n``
with a proposer that always drafts ``n`` tokens (``FixedProposer`` through
vLLM's ``custom_class`` route), so the curve is vLLM's real forward plus its
verification overhead. The flat part of the curve is how big a draft is nearly
free (the "critical decoding length").

    python benchmarks/bench_forward_cost.py --nodes 0 1 2 4 8 16 32 64 \\
        --out benchmarks/results/forward_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class FixedProposer:
    """Drafts ``num_speculative_tokens`` copies of token 0 for every request."""

    def __init__(self, vllm_config) -> None:
        self.n = vllm_config.speculative_config.num_speculative_tokens

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[0] * self.n if s else [] for s in sampled_token_ids]


def step_times(model: str, n: int, context: list[int], steps: int) -> list[float]:
    from vllm import LLM, SamplingParams

    from lookahead_vllm.vllm.offline import engine_kwargs

    kwargs = engine_kwargs("plain")
    if n:
        kwargs["speculative_config"] = {
            "method": "custom_class", "model": "benchmarks.bench_forward_cost.FixedProposer",
            "num_speculative_tokens": n,
        }
    llm = LLM(model=model, **kwargs)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": context}, SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    del llm
    return times[1:-1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", nargs="+", type=int, default=[0, 1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context", type=int, default=288, help="context tokens before decoding")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per point")
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/forward_cost.json")
    args = p.parse_args(argv)
    from lookahead_vllm.vllm.offline import apply_cpu_env

    apply_cpu_env()
    from lookahead_vllm.models import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    rng = np.random.default_rng(0)
    context = rng.integers(100, 20000, size=args.context).tolist()
    rows = []
    for n in args.nodes:
        times = step_times(model, n, context, args.steps)
        rows.append({"draft_tokens": n, "tokens_scored": n + 1, "median_ms": round(1e3 * statistics.median(times), 3),
                     "p90_ms": round(1e3 * float(np.percentile(times, 90)), 3), "steps": len(times)})
        print(f"draft {n:3d} -> scored {n + 1:3d}: median {rows[-1]['median_ms']:.1f} ms", flush=True)
    base = rows[0]["median_ms"]
    for row in rows:
        row["relative"] = round(row["median_ms"] / base, 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"context": args.context, "model": model, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["tokens_scored"] for r in rows], [r["relative"] for r in rows], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens scored per step (root + drafts)")
    ax.set_ylabel("step time / plain decode step")
    ax.set_title("vLLM forward cost, SmolLM2-135M fp32, CPU")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
