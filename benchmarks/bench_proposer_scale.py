"""Drafter cost at serving scale, through the proposer's own interface.

Drives ``LookaheadProposer`` the way vLLM's model runner does (the runner
hook ``on_step``, then ``propose()`` every step over the persistent batch's
token table), with no model forward: ``B`` running requests whose prompts are
real text (the docqa documents, tokenized with the bundled tokenizer), each
committing per step the tokens of its last draft that match its text, then
one more (as verification would: drafts are booked, the calibrator learns).
The heap is frozen before the steps, as vLLM's engine core freezes it once
started. ``--flush-mib`` streams that much memory through the caches before
every step, as the model's forward does between two engine steps: the
proposer then runs with cold caches, as it does in an engine. Load adaptation is raised and the forward-cost model is off, so every row
drafts and every draft is handed out and booked: the most work the proposer
does per step. ``--prices gpu`` prices tokens as on a GPU instead (64 free
tokens: from 64 rows on no draft pays, and the proposer only indexes).
Reports per source (``index``: native draft index; ``index+trie``: plus the
trie, native) and index upkeep (``--upkeep``: ``inline`` at the end of
the batch call, the CPU platform's default; ``thread``: on the index's own
thread while the forward, here the flush and the batch's bookkeeping, runs,
the GPU default) the milliseconds per engine step (median, p99, max), the
milliseconds to admit one more prompt into the running batch (median and max
of 5), and the drafter's memory estimate and process RSS. ``--phases`` also
times the step's phases call by call (:data:`PHASES`: booking, sync, drafting,
planning, the Jacobi pool, windows and their tracking), median ms per call.

Example::

    python benchmarks/bench_proposer_scale.py --batch 64 256 --prompt-tokens 512 2048 --steps 50
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# Prompts admitted one at a time into the running batch after the timed steps.
ADMISSIONS = 5


def make_proposer(source: str, k: int, max_len: int, prices: str = "off", upkeep: str = "inline",
                  draft_shape: str = "one", index_threads: int | None = None) -> Any:
    """The proposer for one cell; ``prices``: "off" (the cost model off: every
    draft handed out) or a platform whose token prices it uses ("gpu");
    ``upkeep``: "inline" or "thread" (the profile's ``upkeep_thread``);
    ``draft_shape``: the config's (``hier``/``par``: trees); ``index_threads``: the profile
    knob (None: the platform's)."""
    from lookahead_lab.standalone import standalone_proposer
    from lookahead_vllm.core.config import PLATFORM_VALUES

    costs = {"cost_free_tokens": 0}
    if prices != "off":
        platform = PLATFORM_VALUES[prices]
        costs = {"cost_free_tokens": platform["free_tokens"], "cost_marginal_tokens": platform["marginal_tokens"]}
    knobs = {"load_shrink_above": 4096, "load_stop_at": 8192, "upkeep_thread": upkeep == "thread"}
    if index_threads is not None:
        knobs["index_threads"] = index_threads
    settings = {"source": source, "draft_shape": draft_shape, "_profile": knobs, **costs}
    return standalone_proposer(k, max_len, settings)


# A step's phases (--phases): name -> (what holds it, its attribute); "module" is the
# proposer's module, whose ``plan_trees`` the step calls. "merge" (every source but the
# index alone) runs "draft" inside it.
PHASES = {
    "book": ("proposer", "_book_trees"),
    "sync": ("drafter", "sync"),
    "draft": ("drafter", "draft_rows"),
    "merge": ("drafter", "draft"),
    "plan": ("module", "plan_trees"),
    "pool": ("proposer", "_pool_rows"),
    "windows": ("proposer", "_send_windows"),
    "track": ("proposer", "_track_windows"),
}


class PhaseTimers:
    """Times every call of the proposer's :data:`PHASES` (each call a few microseconds
    dearer, the step's own figures too) until :meth:`restore`; ``medians()``: ms per call
    of each phase that ran, since the last ``clear()``."""

    def __init__(self, proposer: Any) -> None:
        import lookahead_vllm.vllm.proposer as module

        owners = {"proposer": proposer, "drafter": proposer.drafter, "module": module}
        self.times: dict[str, list[float]] = {}
        self._saved: list[tuple[Any, str, Any]] = []  # (target, attribute, the module's original or None)
        for name, (owner, attr) in PHASES.items():
            target, original = owners[owner], getattr(owners[owner], attr)
            self._saved.append((target, attr, original if owner == "module" else None))
            setattr(target, attr, self._timed(original, self.times.setdefault(name, [])))

    @staticmethod
    def _timed(original: Any, seconds: list[float]) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)
        return timed

    def clear(self) -> None:
        for seconds in self.times.values():
            seconds.clear()

    def medians(self) -> dict[str, float]:
        return {name: 1e3 * statistics.median(s) for name, s in self.times.items() if s}

    def restore(self) -> None:
        """Put every wrapped attribute back (the instances' own go; the module's original returns)."""
        for target, attr, original in self._saved:
            if original is not None:
                setattr(target, attr, original)
            else:
                delattr(target, attr)


def verifiable_requests(proposer: Any, req_ids: list[str]) -> None:
    """Every request samples greedily, as the runner's request states would
    say: in tree mode each may verify a tree (else it gets a chain)."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    greedy = SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))
    proposer.verifier.runner_requests = dict.fromkeys(req_ids, greedy)


def corpus_tokens(count: int) -> np.ndarray:
    """``count`` token ids of real text (docqa documents, bundled tokenizer), repeated as needed."""
    from transformers import AutoTokenizer

    from lookahead_lab.datasets import load_split
    from lookahead_vllm.models import prepare_smollm2

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_smollm2()))
    ids: list[int] = []
    for text in load_split("docqa", "dev", None) + load_split("docqa", "test", None):
        ids += tokenizer(text).input_ids
        if len(ids) >= count:
            break
    reps = -(-count // len(ids))
    return np.array((ids * reps)[:count], np.int32)


class Batch:
    """The runner's persistent batch: request ids, prompt lengths, token table."""

    def __init__(self, texts: list[np.ndarray], prompt_tokens: int, max_len: int,
                 flush: np.ndarray | None = None) -> None:
        self.req_ids = [f"r{i}" for i in range(len(texts))]
        self.num_prompt_tokens = np.full(len(texts), prompt_tokens, np.int64)
        self.token_ids = np.zeros((len(texts), max_len), np.int32)
        for i, t in enumerate(texts):
            self.token_ids[i, :len(t)] = t
        self.num_tokens = np.full(len(texts), prompt_tokens, np.int64)
        # Last step's drafts by request id (none before the first step).
        self.drafts: dict[str, list[int]] = {}
        self.accepted = 0  # draft tokens accepted in all
        self.drafted = 0  # draft tokens handed out in all
        # Streamed through the caches before each step, as the forward
        # between two steps does (None: the proposer runs with warm caches).
        self.flush = flush

    def step(self, proposer: Any, new: list[Any] = ()) -> float:
        """Verify last step's drafts against the text, then time one engine
        step's proposer work (runner hook and propose), in seconds."""
        sampled, scheduled = [], {}
        for i, req_id in enumerate(self.req_ids):
            draft, n = self.drafts.get(req_id, []), int(self.num_tokens[i])
            truth = self.token_ids[i, n:n + len(draft) + 1].tolist()
            accepted = 0
            while accepted < len(draft) and draft[accepted] == truth[accepted]:
                accepted += 1
            sampled.append(truth[:accepted + 1])
            if draft:
                scheduled[req_id] = draft
        self.num_tokens += [len(s) for s in sampled]
        if self.flush is not None:
            self.flush += 1.0
        start = time.perf_counter()
        proposer.on_step(self, [], scheduled)
        if new:
            proposer.on_new_requests(new)
        drafts = proposer.propose(sampled, self.num_tokens, self.token_ids)
        seconds = time.perf_counter() - start
        self.drafts = dict(zip(self.req_ids, drafts))
        self.drafted += sum(map(len, drafts))
        self.accepted += sum(map(len, sampled)) - len(sampled)
        return seconds


def text_tokens(prompt_tokens: int, k: int, steps: int) -> int:
    """Tokens a request's text needs: its prompt, then room for every step
    (timed, batch start and the admissions' three each) to accept a whole
    draft (k tokens) and its bonus."""
    return prompt_tokens + (k + 1) * (steps + 2 + 3 * ADMISSIONS) + 16


def run_cell(source: str, batch: int, prompt_tokens: int, steps: int, k: int, text: np.ndarray,
             prices: str = "off", flush_mib: int = 0, upkeep: str = "inline", draft_shape: str = "one",
             index_threads: int | None = None, phases: bool = False) -> dict[str, Any]:
    max_len = text_tokens(prompt_tokens, k, steps)
    span = max_len
    rng = np.random.default_rng(0)
    texts = [np.roll(text, -int(rng.integers(len(text))))[:span] for _ in range(batch + ADMISSIONS)]
    proposer = make_proposer(source, k, max_len, prices, upkeep, draft_shape, index_threads)
    verifiable_requests(proposer, [f"r{i}" for i in range(batch + ADMISSIONS)])
    flush = np.zeros(flush_mib << 17) if flush_mib else None  # float64: 2**17 per MiB
    runner = Batch(texts[:batch], prompt_tokens, max_len, flush)
    # As vLLM's engine core does once started (freeze_gc_heap): the heap so
    # far (tokenizer, texts, proposer) is static, so the collector's oldest
    # generation does not walk it during the steps.
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    timers = PhaseTimers(proposer) if phases else None
    try:
        admit_all = runner.step(proposer)  # the whole batch admitted at once
        if timers is not None:
            timers.clear()
        times = [runner.step(proposer) for _ in range(steps)]
        phase_ms = timers.medians() if timers is not None else {}
    finally:
        if timers is not None:
            timers.restore()
    drafted, accepted = runner.drafted, runner.accepted  # the admissions below step this batch too
    # One more prompt joins the running batch, ADMISSIONS times, each in a
    # step between two plain ones: an admission's cost is its step's time
    # less the mean of those two.
    admits, grown = [], runner
    for _ in range(ADMISSIONS):
        before = grown.step(proposer)
        n = len(grown.req_ids)
        bigger = Batch(texts[:n + 1], prompt_tokens, max_len, flush)
        bigger.num_tokens[:n], bigger.drafts = grown.num_tokens, grown.drafts
        admit = bigger.step(proposer)
        after = bigger.step(proposer)
        admits.append(admit - statistics.median([before, after]))
        grown = bigger
    gc.unfreeze()
    times_sorted = sorted(times)
    return {
        "source": source, "upkeep": upkeep, "draft_shape": draft_shape, "batch": batch, "prompt_tokens": prompt_tokens,
        "index_threads": proposer.drafter.threads,
        "steps": steps, "k": k, "prices": prices,
        "flush_mib": flush_mib,
        "draft_tokens_per_step": drafted / (steps + 1),
        "accepted_per_request_step": accepted / (batch * (steps + 1)),
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_p99": 1e3 * times_sorted[min(len(times) - 1, int(0.99 * len(times)))],
        "step_ms_max": 1e3 * times_sorted[-1],
        "admit_ms_per_prompt_batch_start": 1e3 * admit_all / batch,
        "admit_ms_one_more_prompt": 1e3 * max(0.0, statistics.median(admits)),
        "admit_ms_one_more_prompt_max": 1e3 * max(0.0, max(admits)),
        **({"phase_ms_median": phase_ms} if phases else {}),
        "drafter_bytes": proposer.drafter.memory_bytes(),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def repeated(run: Any, repeats: int) -> dict[str, Any]:
    """``run()`` ``repeats`` times: the first run's cell with the step and
    admission figures replaced by the median over the runs (the max: the
    largest), and every run's figures under ``runs``."""
    runs = [run() for _ in range(repeats)]
    cell = dict(runs[0])
    for key in ("step_ms_median", "step_ms_p99", "admit_ms_one_more_prompt", "admit_ms_per_prompt_batch_start"):
        cell[key] = statistics.median(r[key] for r in runs)
    for key in ("step_ms_max", "admit_ms_one_more_prompt_max", "max_rss_mib"):
        cell[key] = max(r[key] for r in runs)
    if "phase_ms_median" in cell:
        names = dict.fromkeys(name for r in runs for name in r["phase_ms_median"])
        cell["phase_ms_median"] = {name: statistics.median(r["phase_ms_median"][name] for r in runs
                                                           if name in r["phase_ms_median"]) for name in names}
    cell["repeats"] = repeats
    cell["runs"] = [{key: r[key] for key in ("step_ms_median", "step_ms_p99", "step_ms_max", "admit_ms_one_more_prompt")}
                    for r in runs]
    return cell


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for source, upkeep in sorted({(c["source"], c.get("upkeep", "inline")) for c in cells}):
        rows = [c for c in cells if c["source"] == source and c.get("upkeep", "inline") == upkeep]
        labels = [f"{c['batch']}x{c['prompt_tokens']}" for c in rows]
        ax.plot(labels, [c["step_ms_median"] for c in rows], "o-", label=f"{source} ({upkeep}) median")
        ax.plot(labels, [c["step_ms_max"] for c in rows], "x--", label=f"{source} ({upkeep}) max")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_ylabel("proposer ms per engine step")
    ax.set_xlabel("running requests x prompt tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", nargs="+", type=int, default=[64, 256])
    p.add_argument("--prompt-tokens", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--k", type=int, default=16, help="draft slots (num_speculative_tokens); default as `vllm serve`")
    p.add_argument("--sources", nargs="+", default=["index", "index+trie"],
                   help="draft sources (config `source`)")
    p.add_argument("--prices", choices=["off", "gpu"], default="off",
                   help="off: the cost model off, every draft handed out and booked (the most work); gpu: "
                        "GPU token prices (few drafts pay at 64+ rows)")
    p.add_argument("--upkeep", nargs="+", choices=["inline", "thread"], default=["inline", "thread"],
                   help="where the index's upkeep runs (config index_upkeep): each one a cell")
    p.add_argument("--draft-shape", choices=["one", "hier", "par"], default="one",
                   help="the config's draft_shape: one (chains) or a tree shape, every request greedy (so each "
                        "may verify a tree)")
    p.add_argument("--index-threads", nargs="+", type=int, default=[None],
                   help="the profile's index_threads (threads a step's rows are drafted on; 0 = min(4, cores)): "
                        "each one a cell (default: the platform's)")
    p.add_argument("--flush-mib", type=int, default=0,
                   help="stream this many MiB through the caches before each step, as a forward does between "
                        "two engine steps (0: warm caches, the proposer's own cost)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each cell this many times, each with a fresh proposer (this machine's timings vary "
                        "by ~25%% from run to run): the cell reports the median of the runs' medians and p99s and "
                        "the largest max, with every run's figures")
    p.add_argument("--phases", action="store_true",
                   help="also time the step's phases call by call (booking, sync, drafting, planning, the Jacobi "
                        "pool, windows and their tracking): median ms per call, in the cell (each call a few "
                        "microseconds dearer, the step's figures too)")
    p.add_argument("--out", type=Path, default=RESULTS / "proposer_scale.json")
    args = p.parse_args(argv)
    for flag, values in (("--batch", args.batch), ("--prompt-tokens", args.prompt_tokens), ("--steps", [args.steps]),
                         ("--repeats", [args.repeats])):
        bad = [v for v in values if v < 1]
        if bad:
            p.error(f"{flag} {bad[0]}: must be >= 1")
    if args.flush_mib < 0:
        p.error(f"--flush-mib {args.flush_mib}: must be >= 0")
    bad = [n for n in args.index_threads if n is not None and not 0 <= n <= 256]
    if bad:
        p.error(f"--index-threads {bad[0]}: must be in [0, 256]")
    from lookahead_vllm.core.config import SOURCES

    for source in args.sources:
        if source not in SOURCES:
            p.error(f"--sources {source!r}: must be one of {list(SOURCES)}")
    from lookahead_lab.offline import apply_cpu_env

    apply_cpu_env(VLLM_LOGGING_LEVEL="WARNING")
    text = corpus_tokens(text_tokens(max(args.prompt_tokens), args.k, args.steps) + 48)
    cells = []
    grid = [(s, u, n, b, t) for s in args.sources for u in args.upkeep for n in args.index_threads
            for b in args.batch for t in args.prompt_tokens]
    for source, upkeep, threads, batch, tokens in grid:
        cell = repeated(lambda: run_cell(source, batch, tokens, args.steps, args.k, text, args.prices,
                                         args.flush_mib, upkeep, args.draft_shape, threads, args.phases),
                        args.repeats)
        cells.append(cell)
        log(f"{source:19s} {args.draft_shape:4s} {upkeep:6s} {cell['index_threads']} thr {batch:4d} x {tokens:5d}: "
            f"step {cell['step_ms_median']:.2f} ms median, "
            f"{cell['step_ms_p99']:.2f} p99, {cell['step_ms_max']:.2f} max; admit one prompt "
            f"{cell['admit_ms_one_more_prompt']:.2f} ms; {cell['draft_tokens_per_step']:.0f} draft tokens/step; "
            f"drafter {cell['drafter_bytes'] / 2**20:.1f} MiB"
            + "".join(f"; {name} {ms:.3f}" for name, ms in cell.get("phase_ms_median", {}).items()))
        # The allocator and OpenMP runtime this process started with (the server preloads tcmalloc:
        # lookahead_vllm/cpu_preload.py; run as LD_PRELOAD=$(python -m lookahead_vllm.cpu_preload) python ...).
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "ld_preload": os.environ.get("LD_PRELOAD", ""),
                  "cells": cells}
        args.out.write_text(json.dumps(report, indent=1))
        plot(cells, args.out.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
