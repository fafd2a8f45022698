"""Offline speed benchmark: plain vLLM vs vLLM ngram/suffix vs lookahead, one process, one run.

Methods (``--methods``):
  plain              no speculation: the reference for speedups and mismatches.
  ngram<k>, ngram<k>-w<a>-<b>, suffix, suffix-d<N>
                     vLLM's own methods (``baselines.py``): n-gram prompt
                     lookup with k draft tokens (vLLM's lookup window, or
                     min a, max b; ``ngram8-w2-4``: the window tuned on this
                     machine) and suffix decoding (vLLM's defaults, or tree
                     depth N).
  lookahead...       this project: ``lookahead``, ``lookahead-warm`` and
                     ``lookahead:NAME`` variants (``--variant``).
  ``--preset baselines-ngram`` / ``baselines-suffix`` run every vLLM baseline
  above (ngram k = 4, 8, 16 with both windows; suffix depths 24, 16, 32, 64)
  beside plain and lookahead.

Terms:
  cell       one (dataset, tenant count, batch size); every method generates
             the same prompts in it, and speedups compare methods within a
             cell only.
  tenants    ``--tenants N``: prompt i of a dataset carries vLLM's
             ``cache_salt`` ``"tenant-{i % N}"`` for every method (lookahead's
             default ``draft_sharing`` "per-salt" then drafts each request
             from its own tenant's outputs only); 0, the default, sends no
             salt. Several counts (``--tenants 0 4 7``) give a cell each.
  chunk      the prompts of one ``llm.generate`` call: one prompt at bs=1, eight
             at bs=8. For each chunk every method runs once, in an order rotated
             per chunk, so that noise (another process taking a core) hits all
             methods alike.
  cold       ``lookahead`` and ``suffix...``: a fresh engine per cell whose trie
             (suffix: global tree of past responses) is emptied after the untimed
             warm-up; it then learns from the cell's own prompts and outputs,
             chunk after chunk (that is the method). ``ngram`` keeps no state:
             its engines are built once and shared by every cell.
  warm       ``lookahead-warm`` (and any ``lookahead:NAME-warm`` variant): the
             same engine config, fresh per cell, whose
             trie is preloaded before timing with plain vLLM's greedy outputs
             for the *dev split*: the first ``--warm-prompts`` prompts of the
             dataset's other split (``--split test``, the default, reports the
             test split and warms on dev; generated untimed).
  speedup    method tok/s / plain tok/s in the same cell (all tokens / all timed
             seconds); ``speedup_median`` is the ratio of per-chunk medians and
             ``speedup_paired`` the median of per-chunk ratios.

Example (the README demo, a few minutes on 2 cores)::

    python benchmarks/bench_offline.py --preset demo
"""

import os

from lookahead_lab.offline import CPU_ENV, apply_cpu_env

# vLLM logs (warnings only: no periodic stats lines) to stderr; the table goes to stdout.
_LOG_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
apply_cpu_env(**_LOG_ENV)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

from baselines import NGRAM_BASELINES, SUFFIX_BASELINES, baseline_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DEFAULT_METHODS = ["plain", "ngram4", "ngram8", "suffix", "lookahead", "lookahead-warm"]
# Methods whose engine is built fresh for every cell (their drafter learns):
# any method named "lookahead..." ("lookahead", "lookahead-warm", or a
# "lookahead:NAME" variant from --variant) or "suffix..." (its global tree
# caches every response it has seen).
PER_CELL = "lookahead"
PER_CELL_BASELINE = "suffix"
# Per-cell methods whose name ends so get their trie preloaded (the dev split).
WARM_SUFFIX = "-warm"
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {
        "datasets": ["humaneval"], "num_prompts": 8, "max_tokens": 128,
        "batch_sizes": [1], "methods": ["plain", "ngram8", "suffix", "lookahead"],
    },
    # Every vLLM baseline, in two runs that fit a 24 GB host (8 and 6 engines alive at once).
    "baselines-ngram": {"methods": ["plain", *NGRAM_BASELINES, "lookahead"], "batch_sizes": [1]},
    "baselines-suffix": {"methods": ["plain", *SUFFIX_BASELINES, "lookahead"], "batch_sizes": [1]},
}
# Host memory an engine holds beyond its weights and CPU KV cache (measured:
# 5 engines of the bundled model, 0.54 GB weights and 1 GiB KV each, held 10.7 GB).
ENGINE_RUNTIME_BYTES = int(0.55 * 2**30)
WARMUP_PROMPT = "The three primary colors are"
WARMUP_TOKENS = 32
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Other processes' load (cores) above which the run warns that timings are unreliable.
BUSY_WARNING = 0.25


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    preset = parser.parse_known_args(argv)[0].preset
    if preset:
        parser.set_defaults(**PRESETS[preset])  # explicit flags still win
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="named settings (flags given too override them)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument("--split", default="test", help="reported split: test (default) or dev")
    p.add_argument("--num-prompts", type=int, default=20, help="prompts per dataset from --split")
    p.add_argument("--warm-prompts", type=int, default=None,
                   help="other-split prompts that preload lookahead-warm (default: --num-prompts)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--tenants", nargs="+", type=int, default=[0],
                   help="tenant counts, a cell each: prompt i carries cache_salt 'tenant-{i %% N}' for every "
                        "method (default 0: no cache_salt)")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help="plain, ngram<k>, ngram<k>-w<min>-<max>, suffix, suffix-d<depth>, lookahead, "
                        "lookahead-warm (plain is required; see the module docstring)")
    p.add_argument("--k", type=int, default=None,
                   help="num_speculative_tokens (default: lookahead the platform's, 16 or 8 on a GPU; "
                        "core.config.PLATFORM_DECODING_LENGTH; baselines 16)")
    p.add_argument("--prefix-caching", choices=("off", "on"), default="off",
                   help="vLLM prefix caching in every engine (default off: engines shared across cells, "
                        "plain and ngram, would otherwise reuse the prefill of prompts an earlier cell "
                        "sent, while per-cell engines, lookahead and suffix, prefill them anew)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="engines' max_model_len (default 2048; docqa needs 4096)")
    p.add_argument("--lookahead-config", type=json.loads, default={},
                   help='JSON for additional_config["lookahead"], e.g. \'{"draft_shape": "one"}\'')
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="extra lookahead method 'lookahead:NAME' with these config overrides (repeatable)")
    p.add_argument("--model", default=None, help="model folder (default: bundled SmolLM2-135M-Instruct fp32)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/offline_<time>.json)")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: next to the JSON)")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="run even if every method's engine alive at once may not fit in host memory")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if "plain" not in args.methods:
        parser.error("--methods must include 'plain' (the reference for speedups and mismatches)")
    if len(set(args.methods)) != len(args.methods):
        parser.error("--methods has duplicates")
    for method in args.methods:
        check_method(parser, method)
    check_datasets(parser, args)
    args.variants = {}
    for spec in args.variant:
        name, _, config = spec.partition("=")
        try:
            args.variants[f"lookahead:{name}"] = json.loads(config or "{}")
        except json.JSONDecodeError as exc:
            parser.error(f"--variant {spec!r}: {exc}")
        if f"lookahead:{name}" not in args.methods:
            args.methods.append(f"lookahead:{name}")
    if not isinstance(args.lookahead_config, dict):
        parser.error("--lookahead-config must be a JSON object")
    if min(args.batch_sizes) < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        parser.error("--batch-sizes, --num-prompts and --max-tokens must be >= 1")
    check_tenants(parser, args)
    if args.warm_prompts is None:
        args.warm_prompts = args.num_prompts if any(map(is_warm, args.methods)) else 0
    if args.warm_prompts < 0:
        parser.error(f"--warm-prompts {args.warm_prompts}: must be >= 0")
    stamp = time.strftime("%Y%m%d_%H%M%S")
    # Runs that write inside benchmarks/results/ also refresh offline_latest.*;
    # runs writing elsewhere (tests, scratch) leave the committed results alone.
    args.out = args.out or RESULTS / f"offline_{stamp}.json"
    args.copy_latest = args.out.resolve().parent == RESULTS.resolve()
    args.plot = args.plot or args.out.with_suffix(".png")


def check_tenants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each count 0 (no salt) or 1..--num-prompts (more tenants than prompts leave some empty)."""
    for n in args.tenants:
        if not 0 <= n <= args.num_prompts:
            parser.error(f"--tenants {n}: must be 0 (no cache_salt) or 1..{args.num_prompts} (--num-prompts)")
    if len(set(args.tenants)) != len(args.tenants):
        parser.error(f"--tenants {' '.join(map(str, args.tenants))}: has duplicates")


def check_method(parser: argparse.ArgumentParser, method: str) -> None:
    """A known method name whose numbers vLLM accepts (and whose drafter is installed)."""
    if method == "plain" or method.startswith(PER_CELL):
        return
    try:
        config = baseline_config(method)
    except ValueError as exc:
        parser.error(f"--methods {method!r}: {exc}")
    if config is None:
        parser.error(f"--methods {method!r}: expected plain, ngram<k>, ngram<k>-w<min>-<max>, ngram_gpu<k>, suffix, "
                     "suffix-d<depth>, lookahead, lookahead-warm or lookahead:NAME")
    if config["method"] == "suffix" and not has_suffix_decoding():
        parser.error(f"--methods {method!r}: needs arctic_inference.suffix_decoding; "
                     "install it with scripts/setup.sh (arctic-inference==0.3.0)")


def has_suffix_decoding() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("arctic_inference.suffix_decoding") is not None
    except ModuleNotFoundError:
        return False


def check_datasets(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from lookahead_lab.datasets import DATASETS

    for name in args.datasets:
        if name not in DATASETS:
            parser.error(f"--datasets {name!r}: expected one of {', '.join(DATASETS)}")
    if args.split not in SPLITS:
        parser.error(f"--split {args.split!r}: expected one of {', '.join(SPLITS)}")


# -------------------------------------------------------------------- engines
SPLITS = ("test", "dev")


def tenant_salt(i: int, tenants: int) -> str | None:
    """The ``cache_salt`` of a dataset's prompt ``i`` among ``tenants`` (None: 0, no salt)."""
    return f"tenant-{i % tenants}" if tenants else None


def tenant_prompts(prompts: list[str], tenants: int) -> list[Any]:
    """``prompts`` as vLLM takes them: the texts for 0 tenants, else text
    prompts carrying their tenant's salt (``vllm.inputs.TextPrompt``,
    tokenized exactly like the bare text)."""
    if not tenants:
        return list(prompts)
    return [{"prompt": text, "cache_salt": tenant_salt(i, tenants)} for i, text in enumerate(prompts)]


def is_per_cell(method: str) -> bool:
    """Built fresh for every cell: its drafter learns from what it generates."""
    return method.startswith((PER_CELL, PER_CELL_BASELINE))


def is_warm(method: str) -> bool:
    """``lookahead-warm`` or a ``lookahead:NAME-warm`` variant: trie preloaded."""
    return method.startswith(PER_CELL) and method.endswith(WARM_SUFFIX)


def engine_method(method: str) -> str:
    """The ``engine_kwargs`` method behind a benchmark method name."""
    if method.startswith(PER_CELL):
        return "lookahead"
    config = baseline_config(method)
    return config["method"] if config else method


def lookahead_config(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """--lookahead-config, updated by the method's --variant settings."""
    return {**args.lookahead_config, **args.variants.get(method, {})}


def build_engine(method: str, args: argparse.Namespace, label: str | None = None) -> Any:
    from vllm import LLM

    from lookahead_lab.offline import engine_kwargs

    start = time.perf_counter()
    config = lookahead_config(method, args)
    # A variant's decoding_length is its node budget: vLLM's k follows it,
    # plus the Jacobi window's nodes for source "jacobi"/"both".
    k = args.k
    from lookahead_vllm.core.config import DEFAULT_DECODING_LENGTH, default_decoding_length, resolve
    from lookahead_vllm.vllm.config import current_platform_name

    if engine_method(method) == "lookahead":  # the platform's default, as a user's engine gets it
        window = resolve({**config, "decoding_length": 1}).lookahead_nodes
        k = config.get("decoding_length", args.k or default_decoding_length(current_platform_name())) + window
    if k is None:  # baselines (suffix; ngram names its k): the k every earlier run gave them
        k = DEFAULT_DECODING_LENGTH
    overrides = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    overrides["enable_prefix_caching"] = args.prefix_caching == "on"
    overrides.update(getattr(args, "engine_overrides", None) or {})  # bench_gpu: dtype, CUDA graphs, memory
    kwargs = engine_kwargs(engine_method(method), k=k, lookahead=config, **overrides)
    if baseline_config(method):
        kwargs["speculative_config"] = baseline_config(method)
    llm = LLM(model=str(args.model), **kwargs)
    time_vllm_drafter(llm)
    time_sampling(llm)
    llm.generate([WARMUP_PROMPT], warmup_params(), use_tqdm=False)
    reset_drafters(llm)  # "cold" means cold: forget the warm-up text
    log(f"built {label or method} engine in {time.perf_counter() - start:.1f} s")
    return llm


def warmup_params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS)


def free_engine(llm: Any) -> None:
    """Shut an engine down (see ``offline.shutdown_engine``: a shared engine
    must not run between a shutdown and the next build; bench_cell builds first)."""
    from lookahead_lab.offline import shutdown_engine

    shutdown_engine(llm)


def on_engine(llm: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(root, *args)`` where the engine's drafters live, and its result.

    In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the CPU
    benchmarks): ``root`` is the ``LLM``. An engine core in its own process
    (bench_gpu's CUDA-graph engines): ``fn`` travels by ``collective_rpc``
    (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) and ``root`` is the worker. The
    walks below start from either.
    """
    from vllm.v1.engine.core_client import MPClient

    if not isinstance(getattr(getattr(llm, "llm_engine", None), "engine_core", None), MPClient):
        return fn(llm, *args)  # in this process (or a test's stand-in engine)
    # Results must be plain Python values: a Counter never came back (the call hung, no error).
    return llm.collective_rpc(fn, args=args)[0]


def proposers(root: Any) -> list[Any]:
    from lookahead_lab.offline import find_proposers

    return find_proposers(root)


def engine_objects(root: Any) -> Iterator[Any]:
    """The objects from ``root`` (an ``LLM`` or a worker) down to its model runner, each once."""
    stack, seen = [root], set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        stack += [getattr(obj, n, None) for n in ("llm_engine", "engine_core", "model_executor",
                                                  "driver_worker", "worker", "model_runner")]


def vllm_drafter(root: Any) -> Any:
    """The model runner's ``drafter`` under ``root`` (None: plain)."""
    return next((obj.drafter for obj in engine_objects(root) if getattr(obj, "drafter", None) is not None), None)


def time_vllm_drafter(llm: Any) -> None:
    """Time vLLM's own drafter (ngram, suffix): its ``propose`` adds to
    ``drafter.bench_counters`` the ``ProposerStats`` names drafter_summary reads."""
    on_engine(llm, _time_vllm_drafter)


def _time_vllm_drafter(root: Any) -> None:
    drafter = vllm_drafter(root)
    if drafter is None or proposers(root):  # plain, or lookahead (which counts itself)
        return
    if type(drafter).__name__ == "NgramProposerGPU":  # its propose only launches device work: no host time
        return
    counters: Counter = Counter()
    propose = drafter.propose

    def timed_propose(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        drafts = propose(*args, **kwargs)
        counters.update(propose_ns=time.perf_counter_ns() - start, steps=1, request_steps=len(drafts))
        return drafts

    drafter.propose = timed_propose
    drafter.bench_counters = counters


def time_sampling(llm: Any) -> None:
    """Time the runner's ``_sample`` (vLLM's samplers, or lookahead's argmax path where it
    applies): ``runner.bench_sample_counters`` gets ``sample_ns`` and ``sample_steps``, which
    drafter_counters adds to the drafter's."""
    on_engine(llm, _time_sampling)


def _time_sampling(root: Any) -> None:
    runner = model_runner(root)
    if runner is None or hasattr(runner, "bench_sample_counters"):
        return
    counters: Counter = Counter()
    sample = runner._sample  # the class's method (lookahead's patch included), bound

    def timed_sample(logits: Any, spec_decode_metadata: Any) -> Any:
        start = time.perf_counter_ns()
        out = sample(logits, spec_decode_metadata)
        counters.update(sample_ns=time.perf_counter_ns() - start, sample_steps=1)
        return out

    runner._sample = timed_sample
    runner.bench_sample_counters = counters


def model_runner(root: Any) -> Any:
    """The model runner under ``root`` (the object with an ``input_batch`` and ``execute_model``)."""
    return next((obj for obj in engine_objects(root) if hasattr(obj, "input_batch") and hasattr(obj, "execute_model")),
                None)


STEP_KINDS = ("decode_draftless", "decode_drafted", "mixed")


def start_step_clock(llm: Any) -> None:
    """Log every engine step from now on: when ``execute_model`` began, the step's kind
    (:data:`STEP_KINDS`: decode rows only, without or with draft tokens as scheduled; a prefill
    among them), whether every row in it is new (the first step of a ``generate`` call), the
    draft tokens scheduled and how long its forwards took (:func:`read_step_anatomy`).
    Under async scheduling with vLLM's ``ngram_gpu`` every decode step is scheduled with k
    placeholder drafts, trimmed only inside ``execute_model``: there all count as drafted."""
    on_engine(llm, _start_step_clock)


def _start_step_clock(root: Any) -> None:
    runner = model_runner(root)
    if runner is None:  # nothing to clock: read_step_clock then reports no steps
        return
    if hasattr(runner, "bench_step_log"):
        runner.bench_step_log.clear()
        return
    # Per step: start (ns), kind, every row new, draft tokens scheduled, and the ns its forwards took.
    steps: list[list[Any]] = []
    execute = runner.execute_model

    def clocked(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        rows = len(scheduler_output.num_scheduled_tokens)
        if rows:  # an empty step (nothing scheduled) is no engine step
            drafts = sum(len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values())
            decode = scheduler_output.total_num_scheduled_tokens == rows + drafts
            kind = STEP_KINDS[2] if not decode else STEP_KINDS[1] if drafts else STEP_KINDS[0]
            steps.append([time.perf_counter_ns(), kind, len(scheduler_output.scheduled_new_reqs) == rows, drafts, 0])
        return execute(scheduler_output, *args, **kwargs)

    runner.execute_model = clocked
    runner.bench_step_log = steps
    forward = getattr(runner, "_model_forward", None)
    if forward is not None:  # on a GPU this times the launches only (no synchronisation here)
        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return forward(*args, **kwargs)
            finally:
                if steps:
                    steps[-1][4] += time.perf_counter_ns() - start

        runner._model_forward = timed_forward


def read_step_clock(llm: Any) -> dict[str, Any]:
    """Per step kind: how many steps, and the median time from a step's start to the next one's
    (the engine's cadence: under async scheduling the next step is scheduled while this one
    runs). A step followed by one whose rows are all new ended its ``generate`` call, and the
    next call may come after other engines' chunks: it has no period."""
    return on_engine(llm, _read_step_clock)


def _read_step_clock(root: Any) -> dict[str, Any]:
    periods: dict[str, list[float]] = {kind: [] for kind in STEP_KINDS}
    for period, kind, _, _ in _timed_steps(root):
        periods[kind].append(period / 1e6)
    return {kind: {"steps": len(v), "median_ms": round(statistics.median(v), 3) if v else None}
            for kind, v in periods.items()}


def _timed_steps(root: Any) -> Iterator[tuple[int, str, int, int]]:
    """Each clocked step that has a period: (period ns, kind, draft tokens, forward ns)."""
    steps = getattr(model_runner(root), "bench_step_log", [])
    for (start, kind, _, drafts, forward), (end, _, fresh, _, _) in zip(steps, steps[1:]):
        if not fresh:
            yield end - start, kind, drafts, forward


def read_step_anatomy(llm: Any) -> dict[int, dict[str, Any]]:
    """Decode steps (no prefill) by the draft tokens they scored: how many, their median period
    and the median time of their forwards (the runner's ``_model_forward``; on a CPU the forward
    itself, on a GPU its launches only) and of the rest (the period less the forward: input
    preparation, sampling, drafting, the scheduler and output processing). Draftless steps
    count as 0 draft tokens. Periods as :func:`read_step_clock`'s."""
    return on_engine(llm, _read_step_anatomy)


def _read_step_anatomy(root: Any) -> dict[int, dict[str, Any]]:
    by: dict[int, list[tuple[int, int]]] = {}
    for period, kind, drafts, forward in _timed_steps(root):
        if kind != STEP_KINDS[2]:
            by.setdefault(drafts, []).append((period, forward))
    return {d: {"steps": len(v), "median_ms": round(statistics.median(p for p, _ in v) / 1e6, 3),
                "forward_median_ms": round(statistics.median(f for _, f in v) / 1e6, 3),
                "rest_median_ms": round(statistics.median(p - f for p, f in v) / 1e6, 3)}
            for d, v in sorted(by.items())}


def reset_drafters(llm: Any) -> None:
    """Forget everything drafted from so far: lookahead's tries, suffix's global tree."""
    on_engine(llm, _reset_drafters)


def _reset_drafters(root: Any) -> None:
    for proposer in proposers(root):
        proposer.reset()
    cache = getattr(vllm_drafter(root), "suffix_cache", None)
    for req_id in list(cache.cached_requests if cache is not None else ()):
        cache.evict_cached_response(req_id)


def preload_drafter(llm: Any, outputs: list[list[int]]) -> None:
    """Teach the first proposer past responses (``-warm`` methods)."""
    on_engine(llm, _preload_drafter, outputs)


def _preload_drafter(root: Any, outputs: list[list[int]]) -> None:
    proposers(root)[0].warm_start(outputs)


def drafter_size(llm: Any) -> int | None:
    """What the lookahead drafters learned: trie nodes plus draft-index corpus
    tokens (None: no lookahead proposer)."""
    return on_engine(llm, _drafter_size)


def _drafter_size(root: Any) -> int | None:
    found = proposers(root)
    if not found:
        return None
    index = [p.drafter.index for p in found if getattr(p.drafter, "index", None) is not None]
    return sum(p.trie.num_nodes for p in found if p.trie is not None) + sum(i.corpus_tokens() for i in index)


def calibration(llm: Any) -> dict | None:
    """The first proposer's learned confidence calibration (None: no lookahead or calibration off)."""
    return on_engine(llm, _calibration)


def _calibration(root: Any) -> dict | None:
    found = proposers(root)
    cal = found[0].calibrator if found else None
    return cal.summary() if cal is not None else None


def drafter_counters(llm: Any) -> Counter:
    """Raw ``ProposerStats`` counters summed over the engine's proposers
    (vLLM's own drafters: steps and time from ``time_vllm_drafter``)."""
    return Counter(on_engine(llm, _drafter_counters))


def _drafter_counters(root: Any) -> dict[str, int]:
    total: Counter = Counter(getattr(vllm_drafter(root), "bench_counters", {}))
    total.update(getattr(model_runner(root), "bench_sample_counters", {}))
    for proposer in proposers(root):
        total.update(proposer.stats.counters())
    return {k: int(v) for k, v in total.items()}  # plain ints in a plain dict: collective_rpc's encoder


# ---------------------------------------------------------------- CPU meter
def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    busy = (user + nice + system + irq + softirq + steal) / CLK_TCK
    return busy, usage.ru_utime + usage.ru_stime


@dataclass(slots=True)
class CpuMeter:
    """CPU seconds other processes used between ``start()`` and ``stop()``."""

    other_s: float = 0.0
    wall_s: float = 0.0
    # Other processes' CPU seconds per start/stop interval.
    samples: list[float] = field(default_factory=list)
    _mark: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def start(self) -> None:
        self._mark = (*cpu_seconds(), time.perf_counter())

    def stop(self) -> float:
        busy, own = cpu_seconds()
        other = max(0.0, (busy - self._mark[0]) - (own - self._mark[1]))
        self.other_s += other
        self.samples.append(round(other, 2))
        self.wall_s += time.perf_counter() - self._mark[2]
        return other

    def as_dict(self) -> dict[str, float]:
        cores = self.other_s / self.wall_s if self.wall_s else 0.0
        return {"other_cpu_s": round(self.other_s, 2), "wall_s": round(self.wall_s, 2),
                "other_cores_busy": round(cores, 3), "other_cpu_s_per_interval": self.samples}


# ---------------------------------------------------------------- measuring
@dataclass(slots=True)
class MethodRun:
    """Everything one method produced in one cell."""

    method: str
    token_ids: list[list[int]] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    chunk_seconds: list[float] = field(default_factory=list)
    num_drafts: int = 0
    num_accepted: int = 0
    num_draft_tokens: int = 0
    drafter: Counter = field(default_factory=Counter)
    # Other processes' CPU seconds during each of this method's timed calls.
    noise: CpuMeter = field(default_factory=CpuMeter)
    # drafter_size() when the cell starts and ends.
    drafter_size_start: int | None = None
    drafter_size_end: int | None = None
    # The engine's confidence calibration after the cell (cumulative over its cells).
    calibration: dict | None = None
    # Per step kind, the cell's steps and their median period (read_step_clock).
    step_periods: dict | None = None
    # Decode steps by draft tokens: median period, forward and the rest (read_step_anatomy).
    step_anatomy: dict | None = None

    def run_chunk(self, llm: Any, chunk: list[str], params: Any) -> float:
        """Generate one chunk, timed; return its tok/s."""
        from lookahead_lab.offline import generate

        before = drafter_counters(llm)
        self.noise.start()
        result = generate(llm, chunk, params, batch_size=len(chunk))
        self.noise.stop()
        self.drafter.update(drafter_counters(llm) - before)
        self.token_ids += result.token_ids
        self.chunk_tokens.append(result.num_tokens)
        self.chunk_seconds.append(sum(result.seconds))
        self.num_drafts += result.num_drafts
        self.num_accepted += result.num_accepted
        self.num_draft_tokens += result.num_draft_tokens
        return result.num_tokens / sum(result.seconds)

    @property
    def chunk_tok_s(self) -> list[float]:
        return [t / s for t, s in zip(self.chunk_tokens, self.chunk_seconds)]

    @property
    def tok_s(self) -> float:
        return sum(self.chunk_tokens) / sum(self.chunk_seconds)


def rotated(methods: list[str], i: int) -> list[str]:
    shift = i % len(methods)
    return methods[shift:] + methods[:shift]


def run_cell(tag: str, engines: dict[str, Any], prompts: list[str], bs: int, params: Any,
             meter: CpuMeter) -> dict[str, MethodRun]:
    """Interleave all methods chunk by chunk over ``prompts``."""
    runs = {m: MethodRun(m, drafter_size_start=drafter_size(llm)) for m, llm in engines.items()}
    chunks = [prompts[lo:lo + bs] for lo in range(0, len(prompts), bs)]
    for llm in engines.values():
        start_step_clock(llm)
    for i, chunk in enumerate(chunks):
        meter.start()
        speeds = {m: runs[m].run_chunk(engines[m], chunk, params) for m in rotated(list(engines), i)}
        other = meter.stop()
        shown = ", ".join(f"{m} {speeds[m]:.1f}" for m in engines)
        log(f"[{tag}] chunk {i + 1}/{len(chunks)} tok/s: {shown} | other CPU {other:.1f} s")
    for m, llm in engines.items():
        runs[m].drafter_size_end = drafter_size(llm)
        runs[m].calibration = calibration(llm)
        runs[m].step_periods = read_step_clock(llm)
        runs[m].step_anatomy = read_step_anatomy(llm)
    return runs


# ---------------------------------------------------------------- summaries
def summarize(run: MethodRun, plain: MethodRun) -> dict[str, Any]:
    from lookahead_lab.offline import count_mismatches

    med, plain_med = statistics.median(run.chunk_tok_s), statistics.median(plain.chunk_tok_s)
    mismatched = [i for i, (a, b) in enumerate(zip(plain.token_ids, run.token_ids)) if a != b]
    tokens = sum(run.chunk_tokens)
    return {
        "method": run.method,
        "tokens": tokens,
        "seconds": round(sum(run.chunk_seconds), 3),
        "tok_s": round(run.tok_s, 2),
        "median_chunk_tok_s": round(med, 2),
        "speedup": round(run.tok_s / plain.tok_s, 3),
        "speedup_median": round(med / plain_med, 3),
        "speedup_paired": round(statistics.median(
            a / b for a, b in zip(run.chunk_tok_s, plain.chunk_tok_s)), 3),
        "mean_acceptance_length": round(1 + run.num_accepted / run.num_drafts, 3) if run.num_drafts else None,
        "tokens_per_step": round(tokens / (tokens - run.num_accepted), 3),
        "draft_acceptance_rate": round(run.num_accepted / run.num_draft_tokens, 3) if run.num_draft_tokens else None,
        "num_drafts": run.num_drafts,
        "num_accepted": run.num_accepted,
        "num_draft_tokens": run.num_draft_tokens,
        **drafter_summary(run.drafter),
        "drafter_size_start": run.drafter_size_start,
        "drafter_size": run.drafter_size_end,
        "calibration": run.calibration,
        "mismatches": count_mismatches(plain.token_ids, run.token_ids),
        "mismatched_prompts": mismatched,
        "step_periods": run.step_periods,
        "step_anatomy": run.step_anatomy,
        "chunk_tokens": run.chunk_tokens,
        "chunk_seconds": [round(s, 4) for s in run.chunk_seconds],
        "chunk_other_cpu_s": run.noise.samples,
    }


def drafter_summary(counters: Counter) -> dict[str, Any]:
    steps, req_steps = counters.get("steps", 0), counters.get("request_steps", 0)
    sampled = counters.get("sample_steps", 0)
    sampling = {"sample_ms_per_step": round(counters["sample_ns"] / 1e6 / sampled, 4) if sampled else None}
    if not steps:
        return {"drafter_ms_per_step": None, "drafter_ms_per_request_step": None, "drafter_steps": 0, **sampling}
    ms = counters["propose_ns"] / 1e6
    return {**sampling, "drafter_ms_per_step": round(ms / steps, 4),
            "drafter_ms_per_request_step": round(ms / max(req_steps, 1), 4), "drafter_steps": steps,
            "tree_request_steps": counters.get("tree_request_steps", 0),
            "tree_off_chain_accepts": counters.get("tree_off_chain_accepts", 0),
            "jacobi_steps": counters.get("jacobi_steps", 0),
            "pool_accepted_tokens": counters.get("pool_accepted_tokens", 0),
            "context_drafts": counters.get("context_drafts", 0),
            "context_accepted_tokens": counters.get("context_accepted_tokens", 0),
            "uniform_steps": counters.get("uniform_steps", 0),
            "draftless_steps": counters.get("draftless_steps", 0)}


def warn_mismatches(cell: dict[str, Any]) -> None:
    for row in cell["methods"]:
        if row["mismatches"]:
            log("!" * 78)
            log(f"!!! MISMATCH: {cell['dataset']} tenants={cell.get('tenants', 0)} bs={cell['batch_size']} "
                f"{row['method']}: {row['mismatches']} prompt(s) differ from plain: {row['mismatched_prompts']}")
            log("!" * 78)


# ------------------------------------------------------------------ drivers
def tokenizer_for(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def dataset_split(dataset: str, args: argparse.Namespace, tokenizer: Any) -> tuple[list[str], list[str]]:
    """(reported prompts, warm-up prompts): the first ``--num-prompts`` of
    ``--split`` and the first ``--warm-prompts`` of the other split."""
    import lookahead_lab.datasets as datasets

    if not hasattr(datasets, "load_split"):  # the loader before splits existed
        return legacy_split(dataset, args, tokenizer)
    other = SPLITS[1 - SPLITS.index(args.split)]
    test = datasets.load_split(dataset, args.split, tokenizer, limit=args.num_prompts)
    dev = datasets.load_split(dataset, other, tokenizer, limit=args.warm_prompts) if args.warm_prompts else []
    if len(test) < args.num_prompts or len(dev) < args.warm_prompts:
        raise SystemExit(f"{dataset}: --num-prompts {args.num_prompts} / --warm-prompts {args.warm_prompts} "
                         f"but its {args.split} / {other} splits give {len(test)} / {len(dev)} prompts")
    return test, dev


def legacy_split(dataset: str, args: argparse.Namespace, tokenizer: Any) -> tuple[list[str], list[str]]:
    """Without ``load_split``: the first ``--num-prompts`` and the next ``--warm-prompts``."""
    from lookahead_lab.datasets import load_prompts

    wanted = args.num_prompts + args.warm_prompts
    prompts = load_prompts(dataset, tokenizer, limit=wanted)
    if len(prompts) < wanted:
        raise SystemExit(f"{dataset} has {len(prompts)} prompts; --num-prompts + --warm-prompts = {wanted}")
    return prompts[:args.num_prompts], prompts[args.num_prompts:]


def dev_outputs(plain: Any, dev: list[str], params: Any, dataset: str) -> list[list[int]]:
    """Plain vLLM's greedy outputs for the dev split (untimed)."""
    from lookahead_lab.offline import generate

    start = time.perf_counter()
    ids = generate(plain, dev, params, batch_size=8).token_ids
    log(f"[{dataset}] dev split: {len(dev)} prompts generated in {time.perf_counter() - start:.1f} s")
    return ids


def cell_engines(shared: dict[str, Any], args: argparse.Namespace, dev_ids: list[list[int]]) -> dict[str, Any]:
    """Shared engines plus fresh per-cell ones, in ``--methods`` order."""
    engines = {}
    for method in args.methods:
        engines[method] = shared[method] if method in shared else build_engine(method, args)
    for method in filter(is_warm, engines):
        preload_drafter(engines[method], dev_ids)
    return engines


def bench_cell(dataset: str, bs: int, test: list[str], dev_ids: list[list[int]], shared: dict[str, Any],
               args: argparse.Namespace, params: Any, tenants: int = 0) -> dict[str, Any]:
    engines = cell_engines(shared, args, dev_ids)
    meter = CpuMeter()
    tag = f"{dataset} tenants={tenants} bs={bs}" if tenants else f"{dataset} bs={bs}"
    runs = run_cell(tag, engines, tenant_prompts(test, tenants), bs, params, meter)
    for method in [m for m in engines if is_per_cell(m)]:
        free_engine(engines.pop(method))
    plain = runs["plain"]
    rows = [summarize(runs[m], plain) for m in args.methods]
    cell = {"dataset": dataset, "tenants": tenants, "batch_size": bs, "num_prompts": len(test), **meter.as_dict(),
            "methods": rows}
    warn_mismatches(cell)
    return cell


def engine_bytes(model: Path) -> int:
    """Host memory one engine of ``model`` holds: weights, CPU KV cache, runtime."""
    from vllm.platforms import current_platform

    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    kv = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 4) * 2**30 if current_platform.is_cpu() else 0
    return weights + kv + ENGINE_RUNTIME_BYTES


def check_memory(args: argparse.Namespace, available: int | None = None) -> None:
    """Every method's engine is alive during a cell: refuse a run that cannot fit
    (the kernel would kill it mid-run and every finished cell would be lost)."""
    if args.skip_memory_check:
        return
    each = engine_bytes(args.model)
    need = len(args.methods) * each
    if available is None:
        available = int(_proc_field("/proc/meminfo", "MemAvailable").split()[0]) * 1024
    if need > available:
        raise SystemExit(
            f"bench_offline: --methods/--variant give {len(args.methods)} engines, alive at once during a cell, "
            f"needing about {need / 2**30:.1f} GiB of host memory ({each / 2**30:.2f} GiB each); "
            f"{available / 2**30:.1f} GiB is available. Run fewer methods per process (speedups are relative to "
            "plain in the same run), or pass --skip-memory-check."
        )


def cell_keys(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(dataset, tenants, batch size) of every cell, in run order."""
    return [(ds, n, bs) for ds in args.datasets for n in args.tenants for bs in args.batch_sizes]


def run_benchmark(args: argparse.Namespace, on_cell: Any = None) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=False)
    tokenizer = tokenizer_for(args.model)
    shared = {m: build_engine(m, args) for m in args.methods if not is_per_cell(m)}
    # Everything that uses the shared engines outside a cell happens here, first:
    # shutting a per-cell engine down tears down vLLM's process-global parallel
    # groups, which only the next engine build re-creates (see free_engine).
    splits = {ds: dataset_split(ds, args, tokenizer) for ds in args.datasets}
    warm = any(map(is_warm, args.methods))
    dev_ids = {ds: dev_outputs(shared["plain"], dev, params, ds) if warm else [] for ds, (_, dev) in splits.items()}
    meter = CpuMeter()
    meter.start()
    cells = []
    for ds, tenants, bs in cell_keys(args):
        cells.append(bench_cell(ds, bs, splits[ds][0], dev_ids[ds], shared, args, params, tenants))
        if on_cell is not None:
            on_cell(cells)
    meter.stop()
    while shared:
        free_engine(shared.popitem()[1])
    return {"cells": cells, "run": meter.as_dict()}


# ------------------------------------------------------------------ context
def machine_info() -> dict[str, Any]:
    import torch

    return {
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "mem_total": _proc_field("/proc/meminfo", "MemTotal"),
        "loadavg_at_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _proc_field(path: str, key: str) -> str | None:
    with open(path) as f:
        for line in f:
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return None


def loaded_plugins() -> list[str]:
    """vLLM general plugins this process imported (in-process engines load them
    here): ``lookahead`` only, with ``VLLM_PLUGINS=lookahead`` from CPU_ENV."""
    from importlib.metadata import entry_points

    return sorted(ep.name for ep in entry_points(group="vllm.general_plugins") if ep.module in sys.modules)


def versions() -> dict[str, str]:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__}


def git_info() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def context(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(),
        "versions": versions(),
        "git": git_info(),
        "env": {k: os.environ.get(k) for k in {**CPU_ENV, **_LOG_ENV}},
        "other_cores_busy_at_start": other_load(),
    }


def other_load(seconds: float = 1.0) -> float:
    """Cores other processes keep busy now; warns when timings will be unreliable."""
    meter = CpuMeter()
    meter.start()
    time.sleep(seconds)
    meter.stop()
    cores = meter.as_dict()["other_cores_busy"]
    if cores > BUSY_WARNING:
        log(f"WARNING: other processes keep {cores:.2f} cores busy; with OMP_NUM_THREADS="
            f"{os.environ['OMP_NUM_THREADS']} timings collapse (5-10x) and get noisy. Wait for them, "
            "or rerun with OMP_NUM_THREADS=1. Methods are interleaved, so ratios suffer less than absolute tok/s.")
    return cores


# ------------------------------------------------------------------- output
COLUMNS = ["dataset", "tenants", "bs", "method", "tok/s", "med tok/s", "speedup", "med", "paired", "MAL",
           "acc/draft", "tok/step", "drafter ms", "drafter size", "mismatch"]
LEFT = {"dataset", "method"}


def table_cells(cell: dict[str, Any], row: dict[str, Any]) -> list[str]:
    def opt(value: Any, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    return [cell["dataset"], str(cell.get("tenants", 0)), str(cell["batch_size"]), row["method"], f"{row['tok_s']:.1f}",
            f"{row['median_chunk_tok_s']:.1f}", f"{row['speedup']:.2f}x", f"{row['speedup_median']:.2f}x",
            f"{row['speedup_paired']:.2f}x", opt(row["mean_acceptance_length"], "{:.2f}"),
            opt(row["draft_acceptance_rate"], "{:.2f}"), f"{row['tokens_per_step']:.2f}",
            opt(row["drafter_ms_per_step"], "{:.3f}"), opt(row["drafter_size"], "{}"), str(row["mismatches"])]


def format_table(report: dict[str, Any]) -> str:
    """One row per (dataset, tenants, bs, method), then a noise line per cell. The
    tenants column appears only when some cell salts its prompts (``--tenants``)."""
    keep = [i for i, name in enumerate(COLUMNS)
            if name != "tenants" or any(cell.get("tenants", 0) for cell in report["cells"])]
    columns = [COLUMNS[i] for i in keep]
    body = [[[table_cells(cell, row)[i] for i in keep] for row in cell["methods"]] for cell in report["cells"]]
    widths = [max(len(c[i]) for c in [columns, *sum(body, [])]) for i in range(len(columns))]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) if name in LEFT else v.rjust(w) for name, v, w in zip(columns, values, widths))

    lines = [line(columns), "-" * len(line(columns))]
    for cell, rows in zip(report["cells"], body):
        lines += [line(values) for values in rows]
        lines.append(f"  noise: other processes used {cell['other_cpu_s']:.1f} CPU s over {cell['wall_s']:.1f} s "
                     f"({cell['other_cores_busy']:.2f} cores busy)")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    ncols = min(2, len(cells))
    nrows = (len(cells) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, 4.5 * nrows + 1), squeeze=False)
    for ax, cell in zip(axes.flat, cells):
        plot_cell(ax, cell)
    for ax in list(axes.flat)[len(cells):]:
        ax.axis("off")
    args = report["args"]
    tenants = ",".join(map(str, args.get("tenants", [0])))
    fig.suptitle(f"Offline speedup vs plain vLLM\n{Path(args['model']).name}, greedy, "
                 f"max_tokens={args['max_tokens']}, lookahead k={args['k']}, tenants={tenants} "
                 "(0: no cache_salt)", fontsize=10)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8,
               title="bar labels: tok/s speedup, mean acceptance length (MAL)", title_fontsize=8)
    fig.tight_layout(rect=(0, 0.1 / nrows, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cell(ax: Any, cell: dict[str, Any]) -> None:
    rows = cell["methods"]
    xs = range(len(rows))
    width = 0.38
    total = ax.bar([x - width / 2 for x in xs], [r["speedup"] for r in rows], width, label="tok/s ratio")
    ax.bar([x + width / 2 for x in xs], [r["speedup_median"] for r in rows], width, label="per-chunk median ratio")
    for bar, row in zip(total, rows):
        ax.annotate(bar_label(row), (bar.get_x() + width, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(list(xs), [r["method"] for r in rows], rotation=15)
    ax.set_ylabel("speedup vs plain")
    ax.set_ylim(0, max(max(r["speedup"], r["speedup_median"]) for r in rows) * 1.25)
    plain = rows[0]["tok_s"] if rows[0]["method"] == "plain" else None
    tenants = f" tenants={cell['tenants']}" if cell.get("tenants") else ""
    ax.set_title(f"{cell['dataset']}{tenants} bs={cell['batch_size']} ({cell['num_prompts']} prompts"
                 + (f", plain {plain:.1f} tok/s)" if plain else ")"))


def bar_label(row: dict[str, Any]) -> str:
    mal = row["mean_acceptance_length"]
    label = f"{row['speedup']:.2f}x" + ("" if mal is None else f"\nMAL {mal:.2f}")
    return label + ("\nMISMATCH" if row["mismatches"] else "")


def write_outputs(report: dict[str, Any], args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.plot)
    log(f"wrote {args.out} and {args.plot}")
    if not args.copy_latest:
        return
    for src, dst in ((args.out, RESULTS / "offline_latest.json"), (args.plot, RESULTS / "offline_latest.png")):
        if src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)
    log(f"copied to {RESULTS}/offline_latest.{{json,png}}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model is None:
        from lookahead_vllm.models import prepare_smollm2

        args.model = prepare_smollm2()
    check_memory(args)
    start = time.perf_counter()
    report = context(args)

    def save_partial(cells: list[dict[str, Any]]) -> None:  # a crash later loses no finished cell
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**report, "partial": True, "cells": cells}, indent=1) + "\n")

    report.update(run_benchmark(args, on_cell=save_partial))
    report["vllm_plugins_loaded"] = loaded_plugins()
    report["total_wall_s"] = round(time.perf_counter() - start, 1)
    print(format_table(report))
    print(f"total wall time {report['total_wall_s']:.1f} s; other processes "
          f"{report['run']['other_cores_busy']:.2f} cores busy on average")
    write_outputs(report, args)


if __name__ == "__main__":
    main()
