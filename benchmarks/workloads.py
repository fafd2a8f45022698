"""Replay workloads: prompts of the dataset splits and plain vLLM's greedy outputs for them, cached.

With ``--temperature T`` the outputs are plain vLLM's samples at T instead (one seed per prompt). A replay
over them estimates what speculative sampling accepts: a draft token is accepted with the probability the
model gives it, which is the chance that plain's sampled token equals it, and a rejected one is replaced by a
token drawn from the rest of that distribution, as plain's sample is when it differs.

Shared by the replay scripts (``sim_acceptance.py``, ``suffix_replay.py``,
``copy_ceiling.py``, ``predraft_outlook.py``, ``warm_start_gain.py``): their
common arguments, the cached outputs, the modelled time of plain decoding and
the JSON + PNG they write.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

DEFAULT_CACHE = Path.home() / ".cache" / "lookahead-vllm" / "greedy"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def plain_wave_forwards(lengths: list[int], timing: Callable[[int], float]) -> float:
    """Modeled time of plain decoding for a wave of requests that still
    decode ``lengths`` tokens each: one forward per step over the requests
    still running (``timing(rows)`` single-token forwards)."""
    return sum(timing(sum(n > t for n in lengths)) for t in range(max(lengths, default=0)))


def greedy_outputs(dataset: str, count: int, max_tokens: int, model: Path, cache: Path,
                   split: str = "dev", temperature: float = 0.0) -> tuple[list, list]:
    """(prompt ids, plain vLLM greedy output ids) for the first ``count``
    prompts of ``split``, cached; with ``temperature`` > 0, plain's samples
    at that temperature (prompt ``i`` seeded ``i``)."""
    sampled = f"_t{temperature:g}" if temperature else ""
    path = cache / f"{dataset}_{split}_{count}_{max_tokens}_{model.name}{sampled}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return data["prompts"], data["outputs"]
    from lookahead_lab.offline import apply_cpu_env

    apply_cpu_env(VLLM_LOGGING_LEVEL="WARNING")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from lookahead_lab.datasets import load_split
    from lookahead_lab.offline import engine_kwargs, generate, shutdown_engine

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    texts = load_split(dataset, split, tokenizer, limit=count)
    start = time.perf_counter()
    llm = LLM(model=str(model), **engine_kwargs("plain", max_model_len=4096))  # docqa prompts reach 2.6k tokens
    params = ([SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens) for i in range(len(texts))]
              if temperature else SamplingParams(temperature=0.0, max_tokens=max_tokens))
    outputs = generate(llm, texts, params, batch_size=8).token_ids
    shutdown_engine(llm)
    prompts = [tokenizer(t).input_ids for t in texts]
    kind = "sampled" if temperature else "greedy"
    log(f"[{dataset}] {count} {kind} outputs in {time.perf_counter() - start:.1f} s -> {path}")
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    return prompts, outputs


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """A replay script's parser (described by its docstring's first line)
    with the arguments of every replay over cached greedy outputs: which
    workloads, how many prompts and tokens, the model and the cache."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument("--split", choices=("dev", "test"), default="dev", help="prompt split (tune on dev)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the bundled model)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="greedy outputs cache")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="replay plain's samples at this temperature instead of its greedy outputs (0: greedy)")
    return p


def check_positive(p: argparse.ArgumentParser, **values: int | list[int]) -> None:
    """``p.error`` for the first flag (``num_prompts`` is ``--num-prompts``) with a value below 1."""
    for name, value in values.items():
        for v in value if isinstance(value, list) else [value]:
            if v < 1:
                p.error(f"--{name.replace('_', '-')} {v}: must be >= 1")


def workloads(args: argparse.Namespace, count: int | None = None
              ) -> list[tuple[str, list[list[int]], list[list[int]]]]:
    """``(dataset, prompts, outputs)`` per ``--datasets``: the first ``count``
    (default ``--num-prompts``) prompts of ``--split`` and their greedy
    outputs, from the cache (generated with plain vLLM on a miss). Sets
    ``args.model`` to the bundled model where it was not given."""
    if args.model is None:
        from lookahead_vllm.models import prepare_smollm2

        args.model = prepare_smollm2()
    if args.temperature < 0:
        raise SystemExit(f"--temperature {args.temperature}: must be >= 0")
    return [(dataset, *greedy_outputs(dataset, count or args.num_prompts, args.max_tokens, args.model, args.cache,
                                      args.split, args.temperature)) for dataset in args.datasets]


def save_rows(args: argparse.Namespace, rows: list[dict[str, Any]],
              plot: Callable[[list[dict[str, Any]], Path], None] | None = None) -> None:
    """Writes a replay's ``rows`` and arguments to ``args.out`` as JSON, and
    ``plot``'s figure beside it as PNG (nothing without ``--out``)."""
    if args.out is None:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1) + "\n")
    if plot is not None:
        plot(rows, args.out.with_suffix(".png"))
