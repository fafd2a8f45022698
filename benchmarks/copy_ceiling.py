"""Copy ceiling: the most any drafter that copies earlier text could accept.

Every drafter compared here (lookahead's draft index, vLLM's ``ngram`` and
``suffix``) drafts by copying what followed an earlier occurrence of the
request's last tokens, in its own text or in earlier outputs. This script
bounds them all from above on the same cached greedy outputs the acceptance
simulator replays: at every step an *oracle* that knows the target's next
tokens looks at every earlier position whose preceding token equals the
request's last token (a match of length >= 1), in the request's own prompt
and output so far (a copy that runs into the text's end repeats its period,
as the draft index's does) and in every output finished before it, and
drafts the copy that the target accepts furthest, at most ``k`` tokens. It
sends exactly the tokens that will be accepted, so its steps cost the least
any draft of that length can.

  mal    emitted tokens / steps (accepted + the bonus token), as the simulator.
  speed  modeled speedup over plain decoding under the simulator's
         forward-cost model (this CPU's, or ``--platform gpu``'s): a step
         scoring ``1 + accepted`` tokens costs ``ForwardCost(1 + accepted)``
         single-token forwards.

No drafter that copies can beat ``mal`` at batch 1 with a chain; a drafter's
``speed`` over this ceiling's says how much of the copyable gain it gets.
Requests run one after another (batch 1), earlier outputs joining the corpus
as the simulator's cold cells do.

With ``--drafters`` the same run replays lookahead's defaults
(``sim_acceptance.simulate``) and vLLM's ``suffix`` defaults
(``suffix_replay.replay_suffix``) on the same outputs and timing model, and
plots the three side by side (JSON + PNG).

Example (outputs cached by ``sim_acceptance.py``)::

    python benchmarks/copy_ceiling.py --datasets humaneval mtbench --num-prompts 16 --drafters
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from sim_acceptance import batch1_cost
from workloads import check_positive, plain_wave_forwards, save_rows, workload_parser, workloads


def _accepted_from(source: np.ndarray, starts: np.ndarray, target: np.ndarray, period_end: int | None) -> int:
    """Longest prefix of ``target`` that a copy of ``source`` from any of
    ``starts`` spells. ``period_end``: copies wrap back to their start there
    (own text: the continuation repeats its period); None: they stop at
    ``source``'s end (or a -1 separator)."""
    if not len(starts) or not len(target):
        return 0
    cols = np.arange(len(target))
    if period_end is None:
        idx = starts[:, None] + cols[None, :]
        valid = idx < len(source)
        got = np.where(valid, source[np.minimum(idx, len(source) - 1)], -1)
    else:
        period = period_end - starts
        got = source[starts[:, None] + cols[None, :] % period[:, None]]
    run = np.logical_and.accumulate(got == target[None, :], axis=1)
    return int(run.sum(axis=1).max())


def ceiling(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int,
            timing: Callable[[int], float], warm: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
    """The oracle copy drafter over (prompt, greedy output) pairs at batch 1;
    see the module docstring. ``timing(tokens)``: a forward's modeled cost."""
    if k < 1:
        raise ValueError(f"k={k}: must be >= 1")
    corpus_parts = [np.asarray(list(w) + [-1], np.int64) for w in warm]
    steps = emitted = accepted_total = 0
    forwards = plain_forwards = 0.0
    for prompt, output in zip(prompts, outputs):
        text = np.asarray(list(prompt) + list(output), np.int64)
        corpus = np.concatenate(corpus_parts) if corpus_parts else np.zeros(0, np.int64)
        plain_forwards += plain_wave_forwards([len(output) - 1], timing)
        i = 1  # the prefill emitted output[0]
        while i < len(output):
            end = len(prompt) + i  # context = text[:end]
            last = text[end - 1]
            target = text[end:end + min(k, len(output) - i)]
            own = np.flatnonzero(text[:end - 1] == last) + 1
            best = _accepted_from(text, own, target, end)
            if len(corpus):
                found = np.flatnonzero(corpus[:-1] == last) + 1
                best = max(best, _accepted_from(corpus, found, target, None))
            n = min(best + 1, len(output) - i)
            forwards += timing(1 + best)
            steps += 1
            emitted += n
            accepted_total += best
            i += n
        corpus_parts.append(np.asarray(list(output) + [-1], np.int64))
    return {"mal": emitted / max(steps, 1), "speed": plain_forwards / max(forwards, 1e-9), "steps": steps,
            "tokens": emitted, "accepted_tokens": accepted_total}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Modeled speed and MAL per dataset: suffix, lookahead, the copy ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = [m for m in ("suffix", "lookahead", "copy ceiling") if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(methods)
    for ax, key, label in ((axes[0], "speed", "modeled speedup over plain"), (axes[1], "mal", "tokens per step (MAL)")):
        for j, method in enumerate(methods):
            values = [next((r[key] for r in rows if r["dataset"] == ds and r["method"] == method), 0.0)
                      for ds in datasets]
            ax.bar([i + j * width for i in range(len(datasets))], values, width, label=method)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets, fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    platform = rows[0].get("platform", "cpu").upper() if rows else "CPU"
    fig.suptitle(f"batch 1, {platform} forward-cost model: what copying can reach", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from lookahead_vllm.core.config import resolve

    p = workload_parser(__doc__)
    p.add_argument("--k", type=int, default=16, help="most draft tokens per step (num_speculative_tokens)")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                   help="token prices of the timing model (sim_acceptance.py --platform)")
    p.add_argument("--drafters", action="store_true",
                   help="also replay lookahead's and vLLM suffix's defaults on the same outputs and plot them")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON (and a PNG beside it)")
    args = p.parse_args(argv)
    check_positive(p, num_prompts=args.num_prompts, max_tokens=args.max_tokens, k=args.k)
    timing = batch1_cost(resolve(platform=args.platform))
    rows = []
    for ds, prompts, outputs in workloads(args):
        found = {"copy ceiling": ceiling(prompts, outputs, args.k, timing)}
        if args.drafters:
            from sim_acceptance import simulate
            from suffix_replay import replay_suffix

            found["lookahead"] = simulate({}, prompts, outputs, [], platform=args.platform)
            found["suffix"] = replay_suffix(prompts, outputs, timing=timing)
        for method, r in found.items():
            keep = {k: v for k, v in r.items() if not isinstance(v, (list, dict))}
            rows.append({"dataset": ds, "split": args.split, "platform": args.platform, "method": method,
                         "k": args.k, **keep})
            print(f"{ds:10s} {method:12s} MAL {r['mal']:.3f}  speed {r['speed']:.3f}", flush=True)
    save_rows(args, rows, plot)
    return rows


if __name__ == "__main__":
    main()
