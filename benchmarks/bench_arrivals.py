"""The open loop inside one process: the same Poisson arrivals to each engine, no server.

``bench_serve.py --request-rate`` sends the same arrivals to real OpenAI servers; at 0.25
requests a second there ``suffix``'s latency led lookahead's by 1.13x (1.08-1.17,
docs/results.md). This runs traffic like it against in-process engines (``max_num_seqs`` as the
servers had), stepping each engine by hand and admitting each request at its arrival time, so
what the engine's own steps cost is measured apart from the server around them: per request
TTFT (to the first output token, not the first streamed text), decode time and latency, from
its arrival; per engine step kind the median period (bench_offline's step clock); rounds of new
prompts, the methods' order alternating round by round; every later method's latency paired
with the first's, request by request, with a 95% interval. Unlike bench_serve's servers, each
round draws its own arrivals (seeded by the round; bench_serve seeds by wave), drafters are
emptied before each round, and prefix caching is off.

    python benchmarks/bench_arrivals.py --methods suffix lookahead --num-prompts 16 --rounds 4 \\
        --request-rate 0.25 --out /tmp/arrivals.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_offline as offline  # noqa: E402  (applies the CPU env)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

from bench_serve import mixed_split, poisson_arrivals  # noqa: E402
from paired import ratio_interval  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["suffix", "lookahead"],
                   help="bench_offline method names; every later one's latency is paired with the first's")
    p.add_argument("--num-prompts", type=int, default=16, help="requests a round (each round new prompts)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=0.25, help="Poisson arrivals a second")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=4, help="as bench_serve's servers (its --concurrency)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--split", default="test", choices=["test", "dev"])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="as bench_offline's: a lookahead:NAME method with these lookahead settings")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.variants = {}
    for spec in args.variant:
        name, sep, config = spec.partition("=")
        try:
            fields = json.loads(config) if sep and name else None
        except ValueError as exc:
            p.error(f"--variant {spec!r}: not JSON ({exc})")
        if not isinstance(fields, dict):
            p.error(f"--variant {spec!r}: expected NAME=JSON object")
        args.variants[f"lookahead:{name}"] = fields
    named = {m for m in args.methods if m.startswith("lookahead:")}
    for method in sorted(named - set(args.variants)):
        p.error(f"--methods {method!r}: no --variant {method.partition(':')[2]}=JSON given")
    for method in sorted(set(args.variants) - named):
        p.error(f"--variant {method.partition(':')[2]}: not among --methods (add {method!r})")
    if len(args.methods) < 2 or len(set(args.methods)) != len(args.methods):
        p.error(f"--methods {' '.join(args.methods)}: needs two or more different methods")
    for name, value, low in (("--num-prompts", args.num_prompts, 1), ("--rounds", args.rounds, 1),
                             ("--max-tokens", args.max_tokens, 2), ("--max-num-seqs", args.max_num_seqs, 1),
                             ("--max-model-len", args.max_model_len, 16)):
        if value < low:
            p.error(f"{name} {value}: must be >= {low}")
    if not args.request_rate > 0:
        p.error(f"--request-rate {args.request_rate}: must be > 0")
    for method in args.methods:
        offline.check_method(p, method)
    return args


def engine_args(args: argparse.Namespace) -> SimpleNamespace:
    """bench_offline.build_engine's arguments for these (each method's engine: the variants' settings,
    ``max_num_seqs`` as the servers had, prefix caching off)."""
    return SimpleNamespace(model=args.model, k=None, lookahead_config={}, prefix_caching="off", variants=args.variants,
                           max_model_len=args.max_model_len, engine_overrides={"max_num_seqs": args.max_num_seqs})


def run_round(llm: Any, name: str, prompts: list[str], arrivals: list[float], params: Any) -> list[dict[str, Any]]:
    """Admit request i at ``arrivals[i]`` seconds and step the engine until every one finished;
    per request its TTFT, decode time, latency (from its arrival) and output tokens."""
    engine = llm.llm_engine
    start, admitted = time.perf_counter(), 0
    first: dict[int, float] = {}
    done: dict[int, tuple[float, list[int]]] = {}
    while len(done) < len(prompts):
        now = time.perf_counter() - start
        while admitted < len(prompts) and arrivals[admitted] <= now:
            engine.add_request(f"{name}-{admitted}", prompts[admitted], params)
            admitted += 1
        if not engine.has_unfinished_requests():  # idle until the next arrival
            time.sleep(max(0.0, min(0.05, arrivals[admitted] - now)))
            continue
        for output in engine.step():
            i, t = int(output.request_id.rsplit("-", 1)[1]), time.perf_counter() - start
            if output.outputs and output.outputs[0].token_ids:
                first.setdefault(i, t)
            if output.finished:
                done[i] = (t, list(output.outputs[0].token_ids))
    return [{"arrival_s": arrivals[i], "ttft_s": first[i] - arrivals[i], "decode_s": done[i][0] - first[i],
             "latency_s": done[i][0] - arrivals[i], "token_ids": done[i][1]} for i in range(len(prompts))]


def summarize(requests: dict[str, list[dict[str, Any]]], reference: str, method: str) -> dict[str, Any]:
    """``method`` over ``reference`` request by request: geometric means of each figure's ratio and
    their 95% intervals, how many requests ``method`` was faster on, and the mismatched outputs."""
    pairs = list(zip(requests[method], requests[reference]))
    summary: dict[str, Any] = {"requests": len(pairs),
                               "mismatches": sum(a["token_ids"] != b["token_ids"] for a, b in pairs),
                               "faster": sum(a["latency_s"] < b["latency_s"] for a, b in pairs)}
    for key in ("latency_s", "ttft_s", "decode_s"):
        ratios = [a[key] / b[key] for a, b in pairs if a[key] > 0 and b[key] > 0]
        mean, low, high = ratio_interval(ratios) if ratios else (None, None, None)
        summary[key.removesuffix("_s")] = {"ratio": mean, "ci95": [low, high]}
    return summary


def main(argv: list[str] | None = None) -> int:
    from vllm import SamplingParams

    args = parse_args(argv)
    if args.model is None:
        from lookahead_vllm.models import prepare_smollm2

        args.model = str(prepare_smollm2())
    tokenizer = offline.tokenizer_for(args.model)
    prompts = mixed_split(args.split, tokenizer)[:args.num_prompts * args.rounds]
    if len(prompts) < args.num_prompts * args.rounds:
        raise SystemExit(f"--num-prompts {args.num_prompts} x --rounds {args.rounds}: the {args.split} splits hold "
                         f"{len(prompts)} prompts")
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    if longest + args.max_tokens > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len}: a {longest}-token prompt plus --max-tokens "
                         f"{args.max_tokens} does not fit")
    eargs = engine_args(args)
    engines = {m: offline.build_engine(m, eargs) for m in args.methods}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    requests: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    steps: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    meter = offline.CpuMeter()
    for r in range(args.rounds):
        batch = prompts[r * args.num_prompts:(r + 1) * args.num_prompts]
        arrivals = poisson_arrivals(len(batch), args.request_rate, seed=r)
        for method in args.methods if r % 2 == 0 else args.methods[::-1]:
            offline.reset_drafters(engines[method])
            offline.start_step_clock(engines[method])
            meter.start()
            rows = run_round(engines[method], f"{method}-{r}", batch, arrivals, params)
            meter.stop()
            requests[method] += [{"round": r, "prompt": r * args.num_prompts + i, **row} for i, row in enumerate(rows)]
            steps[method].append(offline.read_step_clock(engines[method]))
            offline.log(f"round {r + 1}/{args.rounds} {method}: mean latency "
                        f"{statistics.fmean(x['latency_s'] for x in rows):.2f} s, steps {steps[method][-1]}")
    reference = args.methods[0]
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "versions": offline.versions(),
              "git": offline.git_info(), "other_cpu": meter.as_dict(),
              "summary": {m: summarize(requests, reference, m) for m in args.methods[1:]},
              "step_periods": steps,
              "requests": {m: [{k: v for k, v in x.items() if k != "token_ids"} for x in rows]
                           for m, rows in requests.items()}}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    for method, s in report["summary"].items():
        lat = s["latency"]
        bounds = "" if lat["ci95"][0] is None else f" ({lat['ci95'][0]:.3f}-{lat['ci95'][1]:.3f})"
        print(f"{method} over {reference}, request by request: latency {lat['ratio']:.3f}x{bounds}, "
              f"TTFT {s['ttft']['ratio']:.3f}x, decode {s['decode']['ratio']:.3f}x; faster on {s['faster']} of "
              f"{s['requests']}; {s['mismatches']} mismatches")
    return 1 if any(s["mismatches"] for s in report["summary"].values()) else 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine.step() in this process
    sys.exit(main())
