"""Serving benchmark: plain vs vLLM ngram/suffix vs lookahead, through real OpenAI-compatible servers.

One server per method (``lookahead-vllm-serve``, same flags apart from the
speculation), all started before timing and kept for the whole run, so every
drafter that learns across requests (``suffix``'s global tree, lookahead's
corpus) sees the whole run's traffic. For each workload class (``--datasets``,
the ``--split`` of ``lookahead_lab.datasets``) and each concurrency ``c``, the
cell's own prompts (the split's next ones: cells share no prompt) are cut
into *waves* of ``c`` requests sent at once (streaming completions, greedy);
for each wave every method runs once, in an order rotated wave by wave, so
that noise hits all methods alike.

The class ``mixed`` interleaves all six classes' prompts (code, editing,
chat, long-document QA, agent-style turns) round robin: a server's real mix,
and enough prompts for a load curve up to c=32 with several waves per cell
and no prompt sent twice (``--waves W`` sends ``W`` waves at every ``c``).

Reported per (class, concurrency, method): request latency p50 / p99 (send to
last token), time to first token p50, output tok/s (all tokens / all wave
wall seconds), the speedup vs plain, and per wave the paired ratio to plain
(same prompts, same moment): their geometric mean with a 95% confidence
interval (Student t on the log ratios; one wave gives none), the mean acceptance length and the share
of drafted tokens accepted (from the server's ``vllm:spec_decode_*`` counters),
and mismatches (requests whose text differs from plain's: must be 0; greedy only: with
``--temperature T`` the requests sample, ignoring the end-of-text token, and their texts are not compared;
``--sampled-share F`` makes a share F of them sample and the rest greedy, in the same waves). Every
request's latency, TTFT, tokens and send time (seconds into its wave) and every
prompt's length are kept in the cell (what a tail is made of). Other
processes' CPU use is measured around every wave (machine busy jiffies minus
the CPU time of this script's process tree).

    python benchmarks/bench_serve.py                      # humaneval, c = 1, 4, 16 -> benchmarks/results/serve_latest.{json,png}
    python benchmarks/bench_serve.py --datasets humaneval codeedit mtbench chat docqa agent --concurrency 1 8 --num-prompts 6 16
    python benchmarks/bench_serve.py --datasets mixed --concurrency 1 4 8 16 32 --waves 4   # the load curve
    python benchmarks/bench_serve.py --datasets mixed --concurrency 8 --depth 4 --waves 9 --max-tokens 128 --vary-lengths 16   # sustained, answers of varied length
    python benchmarks/bench_serve.py --datasets mixed --concurrency 8 --depth 4 --waves 9 --max-tokens 64 --request-rate 0.7   # open loop: equal arrivals
    python benchmarks/bench_serve.py --datasets mixed --concurrency 1 8 --waves 12 --temperature 0.8   # sampled
    python benchmarks/bench_serve.py --datasets mixed --concurrency 8 --temperature 0.8 --sampled-share 0.5  # half
    python benchmarks/bench_serve.py --methods plain lookahead --concurrency 1 --num-prompts 2 --max-tokens 16 --out /tmp/s.json   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Sequence

from baselines import PLAIN_SYNC, baseline_config
from paired import ratio_interval

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
# Methods: "plain", "lookahead" (--speculative-model lookahead) and any vLLM
# baseline name of baselines.py ("ngram8-w2-4", "suffix", "suffix-d32", ...).
DEFAULT_METHODS = ["plain", "ngram8-w2-4", "suffix", "lookahead"]
# --datasets name of all classes interleaved (mixed_split).
MIXED = "mixed"
# vLLM's speculative-decoding counters (Prometheus names, "_total" dropped).
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def method_flags(method: str, variants: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """The server flags of a method name: ``lookahead`` with the fields of ``variants[""]``
    (``--lookahead-config``) if any, ``lookahead:NAME`` with those of ``variants[NAME]``
    (``--variant``); ``ValueError`` naming what is allowed otherwise."""
    if method == "plain":
        return []
    if method == PLAIN_SYNC:
        return ["--no-async-scheduling"]
    if method == "lookahead" or method.startswith("lookahead:"):
        name = method.partition(":")[2]
        fields = (variants or {}).get(name)
        if name and fields is None:
            raise ValueError(f"no --variant {name}=JSON given")
        flags = ["--speculative-model", "lookahead"]
        return [*flags, "--additional-config", json.dumps({"lookahead": fields})] if fields else flags
    config = baseline_config(method)
    if config is None:
        raise ValueError("expected plain, plain-sync, lookahead, lookahead:NAME, ngram<k>[-w<min>-<max>], "
                         "ngram_gpu<k>[-w<min>-<max>] or suffix[-d<depth>]")
    return ["--speculative-config", json.dumps(config)]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Cell:
    # Per method: request latencies and TTFTs (s), wave tokens and wave seconds, texts by prompt index,
    # and the growth of the server's speculative-decoding counters over the cell.
    latency: dict[str, list[float]] = field(default_factory=dict)
    ttft: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    texts: dict[str, dict[int, str]] = field(default_factory=dict)
    # Per method, per request in prompt order: its tokens and when it was sent (s from its wave's start).
    request_tokens: dict[str, list[int]] = field(default_factory=dict)
    sent: dict[str, list[float]] = field(default_factory=dict)
    spec: dict[str, dict[str, float]] = field(default_factory=dict)
    other_cpu_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    open_loop: bool = False  # requests sent at arrival times, not as others finish
    # The prompts (by index) that sampled: their texts differ by their draws, so none is compared with plain's.
    sampled: frozenset[int] = frozenset()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(model: str, methods: list[str], args: argparse.Namespace, log_dir: Path) -> list[Server]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env.setdefault("OMP_NUM_THREADS", str(args.omp_threads))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # Only our plugin: arctic-inference's (installed for suffix) stays out of every server.
    env.setdefault("VLLM_PLUGINS", "lookahead")
    servers = []
    for name in methods:
        port = free_port()
        cmd = [sys.executable, "-m", "lookahead_vllm.serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--enforce-eager", "--dtype", "float32", "--max-model-len", str(args.max_model_len), "--seed", "0",
               "--max-num-seqs", str(max(args.concurrency)), *method_flags(name, args.variants)]
        log = open(log_dir / f"serve_{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        servers.append(Server(name, proc, port, model))
    deadline = time.monotonic() + 600
    for s in servers:
        while not _healthy(s):
            if s.proc.poll() is not None or time.monotonic() > deadline:
                stop_servers(servers)
                raise SystemExit(f"{s.name} server did not start; see {log_dir}/serve_{s.name}.log")
            time.sleep(1)
    return servers


def _healthy(s: Server) -> bool:
    try:
        with urllib.request.urlopen(f"{s.url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def stop_servers(servers: list[Server]) -> None:
    for s in servers:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGINT)
    for s in servers:
        try:
            s.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(timeout=30)


async def one_request(client: Any, server: Server, prompt: str, max_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0) -> tuple[float, float, int, str]:
    """One streamed completion: greedy, or sampled at ``temperature`` (and ``top_p``) with the end-of-text token
    ignored (every method then generates ``max_tokens``, whatever its draws)."""
    start = time.perf_counter()
    ttft, text, tokens = None, "", 0
    stream = await client.completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True} if temperature else None,
    )
    async for chunk in stream:
        for c in chunk.choices:
            if c.text and ttft is None:
                ttft = time.perf_counter() - start
            text += c.text
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return time.perf_counter() - start, ttft or 0.0, tokens, text


async def run_wave(server: Server, prompts: list[str], max_tokens: int | Sequence[int], in_flight: int | None = None,
                   arrivals: Sequence[float] | None = None, temperature: float | Sequence[float] = 0.0,
                   top_p: float = 1.0) -> tuple[float, list]:
    """Send ``prompts`` (``max_tokens`` each, or the i-th cap to the i-th; ``temperature`` likewise) with at most
    ``in_flight`` requests out at once (None: all at once), or each at its ``arrivals``
    offset (seconds from the wave's start, whatever is in flight: an open loop);
    the wave's wall seconds and each request's result (latency, TTFT, tokens, text, seconds
    from the wave's start to its sending), in prompt order."""
    from openai import AsyncOpenAI

    # A connection per request: an idle kept-alive one the server is closing (uvicorn drops them after
    # 5 s) can take a request and fail it with a ReadError, as the open loop's gaps did.
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=600, max_retries=0,
                         default_headers={"Connection": "close"})
    slots = asyncio.Semaphore(in_flight or len(prompts))

    caps = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    temps = [temperature] * len(prompts) if isinstance(temperature, (int, float)) else list(temperature)

    async def limited(prompt: str, cap: int, temp: float, at: float | None) -> tuple[float, float, int, str, float]:
        if at is not None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with slots:
            sent = time.perf_counter() - start
            return (*await one_request(client, server, prompt, cap, temp, top_p if temp else 1.0), sent)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(p, cap, temp, at) for p, cap, temp, at in
                                     zip(prompts, caps, temps,
                                         arrivals if arrivals is not None else [None] * len(prompts))))
    wall = time.perf_counter() - start
    await client.close()
    return wall, results


def spec_counters(server: Server) -> dict[str, float]:
    """The server's speculative-decoding counters (:data:`SPEC_COUNTERS`, summed over
    their label sets; absent ones are left out, as on a server that does not speculate)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return parse_counters(text, SPEC_COUNTERS)


def parse_counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the Prometheus samples ``<name>_total{...} value`` in ``text`` per name."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        metric, _, value = line.rpartition(" ")
        base = metric.split("{", 1)[0]
        for name in names:
            if base == f"{name}_total":
                totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def proc_table() -> dict[int, tuple[int, float, int]]:
    """Every live process: pid -> (parent pid, CPU seconds (user + system), resident bytes)."""
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        table[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, rss)
    return table


def root_of(pid: int, roots: Collection[int], table: dict[int, tuple[int, float, int]]) -> int:
    """The first of ``roots`` met walking up from ``pid`` (itself included) in ``table``; 0 if none."""
    while pid and pid not in roots:
        pid = table[pid][0] if pid in table else 0
    return pid


def tree_cpu_seconds(root_pids: list[int]) -> float:
    """CPU seconds (user + system) of the live processes under ``root_pids`` (inclusive)."""
    table = proc_table()
    return sum(cpu for pid, (_, cpu, _) in table.items() if root_of(pid, root_pids, table))


def busy_seconds() -> float:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_cell(servers: list[Server], prompts: list[str], c: int, max_tokens: int | Sequence[int], depth: int = 1,
             rate: float | None = None, temperature: float | Sequence[float] = 0.0, top_p: float = 1.0) -> Cell:
    """Waves of ``c * depth`` prompts, at most ``c`` requests in flight, or (``rate`` requests a
    second) sent at Poisson arrival times, the same for every method; every method runs each wave
    (``max_tokens``, ``temperature``: one for every prompt, or one per prompt; a request samples
    where its temperature is not 0)."""
    temps = [temperature] * len(prompts) if isinstance(temperature, (int, float)) else list(temperature)
    cell = Cell(open_loop=rate is not None, sampled=frozenset(i for i, t in enumerate(temps) if t > 0))
    roots = [os.getpid()] + [s.proc.pid for s in servers]
    spec_before = {s.name: spec_counters(s) for s in servers}
    start = time.perf_counter()
    size = c * depth
    for w, lo in enumerate(range(0, len(prompts), size)):
        wave = prompts[lo:lo + size]
        order = servers[w % len(servers):] + servers[:w % len(servers)]
        # one wave's caps and arrival times, the same for every method
        caps = max_tokens if isinstance(max_tokens, int) else max_tokens[lo:lo + size]
        wave_temps = temps[lo:lo + size]
        arrivals = poisson_arrivals(len(wave), rate, seed=w) if rate else None
        busy0, ours0 = busy_seconds(), tree_cpu_seconds(roots)
        for s in order:
            wall, results = asyncio.run(run_wave(s, wave, caps, None if rate else c, arrivals, wave_temps, top_p))
            cell.seconds.setdefault(s.name, []).append(wall)
            cell.tokens.setdefault(s.name, []).append(sum(r[2] for r in results))
            cell.latency.setdefault(s.name, []).extend(r[0] for r in results)
            cell.ttft.setdefault(s.name, []).extend(r[1] for r in results)
            cell.request_tokens.setdefault(s.name, []).extend(r[2] for r in results)
            cell.sent.setdefault(s.name, []).extend(r[4] for r in results)
            for i, r in enumerate(results):
                cell.texts.setdefault(s.name, {})[lo + i] = r[3]
        cell.other_cpu_s.append(max(0.0, (busy_seconds() - busy0) - (tree_cpu_seconds(roots) - ours0)))
        print(f"  c={c} wave {w + 1}: " + ", ".join(
            f"{s.name} {cell.tokens[s.name][-1] / cell.seconds[s.name][-1]:.1f} tok/s" for s in servers
        ), file=sys.stderr, flush=True)
    cell.wall_s = time.perf_counter() - start
    for s in servers:
        after = spec_counters(s)
        cell.spec[s.name] = {k: v - spec_before[s.name].get(k, 0.0) for k, v in after.items()}
    return cell


def sampling_temperatures(n: int, temperature: float, share: float = 1.0) -> list[float]:
    """Each of ``n`` requests' temperature: ``temperature`` for a ``share`` of them spread evenly in
    prompt order (request i samples when ``floor((i + 1) * share)`` passes ``floor(i * share)``), 0 for
    the rest."""
    return [temperature if math.floor((i + 1) * share) > math.floor(i * share) else 0.0 for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def acceptance(spec: dict[str, float]) -> dict[str, float | None]:
    """Mean acceptance length (tokens per verified draft step, bonus included) and the
    share of drafted tokens accepted, from the growth of :data:`SPEC_COUNTERS` (None
    where nothing was drafted)."""
    drafts = spec.get("vllm:spec_decode_num_drafts", 0.0)
    drafted = spec.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = spec.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None}


def paired_wave_ratios(values: list[float], plain: list[float], size: int) -> list[float]:
    """Per wave (``size`` requests, in prompt order for every method), the geometric mean of each
    request's value over plain's for the same prompt; requests with a zero on either side skipped."""
    ratios = []
    for lo in range(0, min(len(values), len(plain)), size):
        wave = [v / p for v, p in zip(values[lo:lo + size], plain[lo:lo + size]) if v > 0 and p > 0]
        if wave:
            ratios.append(statistics.geometric_mean(wave))
    return ratios


def paired_wave_percentiles(values: list[float], plain: list[float], size: int, q: float = 0.99) -> list[float]:
    """Per wave (``size`` requests, in prompt order for every method), the ``q`` percentile of the
    method's values over plain's in the same wave: a tail compared wave by wave, so the machine's
    drift between waves cancels (the pooled p99 does not)."""
    ratios = []
    for lo in range(0, min(len(values), len(plain)), size):
        mine, theirs = values[lo:lo + size], plain[lo:lo + size]
        if mine and theirs and percentile(theirs, q) > 0:
            ratios.append(percentile(mine, q) / percentile(theirs, q))
    return ratios


def summarize(cell: Cell, c: int, dataset: str, depth: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = {"dataset": dataset, "concurrency": c, "depth": depth, "wall_s": cell.wall_s,
                           "other_cpu_s": sum(cell.other_cpu_s),
                           "other_cores_busy": sum(cell.other_cpu_s) / cell.wall_s, "methods": {}}
    plain_tok_s = sum(cell.tokens["plain"]) / sum(cell.seconds["plain"])
    for name in cell.latency:
        tok_s = sum(cell.tokens[name]) / sum(cell.seconds[name])
        ratios = [(t / s) / (pt / ps) for t, s, pt, ps in
                  zip(cell.tokens[name], cell.seconds[name], cell.tokens["plain"], cell.seconds["plain"])]
        geomean, low, high = ratio_interval(ratios)
        size = c * depth
        ttft_ratio, ttft_low, ttft_high = ratio_interval(paired_wave_ratios(cell.ttft[name], cell.ttft["plain"], size))
        lat_ratio, lat_low, lat_high = ratio_interval(paired_wave_ratios(cell.latency[name], cell.latency["plain"], size))
        p99_ratio, p99_low, p99_high = ratio_interval(paired_wave_percentiles(cell.latency[name],
                                                                             cell.latency["plain"], size))
        out["methods"][name] = {
            "output_tok_s": tok_s,
            "speedup": tok_s / plain_tok_s,
            "speedup_paired_median": statistics.median(ratios),
            "speedup_waves": ratios,
            "speedup_geomean": geomean,
            "speedup_ci95": [low, high],
            "latency_p50_s": percentile(cell.latency[name], 0.5),
            "latency_p99_s": percentile(cell.latency[name], 0.99),
            "ttft_p50_s": percentile(cell.ttft[name], 0.5),
            # Paired with plain request by request (same prompt, same wave), each wave's geometric
            # mean, then the interval over waves: tells a TTFT or latency change from prompt mix.
            "ttft_ratio_geomean": ttft_ratio, "ttft_ratio_ci95": [ttft_low, ttft_high],
            "latency_ratio_geomean": lat_ratio, "latency_ratio_ci95": [lat_low, lat_high],
            # Each wave's p99 over plain's in the same wave (paired_wave_percentiles), then the interval.
            "latency_p99_ratio_geomean": p99_ratio, "latency_p99_ratio_ci95": [p99_low, p99_high],
            "tokens": sum(cell.tokens[name]),
            "seconds": sum(cell.seconds[name]),
            "requests": len(cell.latency[name]),
            # Greedy requests only; None when every request sampled.
            "mismatches": None if len(cell.sampled) == len(cell.texts["plain"]) else sum(
                cell.texts[name][i] != cell.texts["plain"][i] for i in cell.texts["plain"] if i not in cell.sampled),
            **acceptance(cell.spec.get(name, {})),
            # How many of a wave's refills went out together (closed loop: 1.0 each alone, c in lockstep).
            "refills_sent_together": None if cell.open_loop else refills_sent_together(cell.sent.get(name, []), c, size),
            # Request by request in prompt order (what a tail is made of): rounded to the millisecond.
            "per_request": {"latency_s": _ms(cell.latency[name]), "ttft_s": _ms(cell.ttft[name]),
                            "sent_s": _ms(cell.sent.get(name, [])), "tokens": cell.request_tokens.get(name, [])},
        }
    against_plain_sync(out)
    return out


def refills_sent_together(sent: list[float], c: int, size: int, within: float = 0.1) -> float | None:
    """Per wave (``size`` requests, sent ``sent`` seconds after its start, at most ``c`` in
    flight), the requests sent after the first ``c`` are refills, each sent when one before it
    finished; the mean, over refills, of how many of the wave's refills were sent within
    ``within`` seconds of it (itself included). Plain decoding of equal-length answers finishes
    its requests together, so their refills go out, and their prompts are prefilled, together:
    its TTFT then holds the batched prefills and its decodes run between them, while a drafting
    method's requests finish apart and its refills' prefills land inside the others' decodes.
    None: no refills (waves of at most ``c``)."""
    counts = []
    for lo in range(0, len(sent), size):
        refills = sorted(sent[lo:lo + size])[c:]
        counts += [sum(abs(t - u) < within for u in refills) for t in refills]
    return statistics.mean(counts) if counts else None


def _ms(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


def against_plain_sync(cell: dict[str, Any]) -> None:
    """With a ``plain-sync`` server in the cell, every drafting method's
    tok/s over it too (``vs_plain_sync``: geometric mean of the waves' paired
    ratios and its 95% interval): what the method gains over the engine it
    runs in, async scheduling apart."""
    methods = cell["methods"]
    reference = methods.get(PLAIN_SYNC)
    if reference is None:
        return
    for name, m in methods.items():
        if name in ("plain", PLAIN_SYNC):
            continue
        ratios = [a / b for a, b in zip(m["speedup_waves"], reference["speedup_waves"])]
        geomean, low, high = ratio_interval(ratios)
        m["vs_plain_sync"] = {"waves": ratios, "geomean": geomean, "ci95": [low, high]}


def print_table(cells: list[dict[str, Any]]) -> None:
    head = f"{'dataset':<10} {'conc':>4}  {'method':<12} {'tok/s':>7} {'speedup':>8} {'paired':>7} {'95% CI':>13} " \
           f"{'p50 s':>7} {'p99 s':>7} {'ttft p50':>8} {'MAL':>5} {'acc':>5} {'mismatch':>8}"
    print(head)
    print("-" * len(head))
    for cell in cells:
        for name, m in cell["methods"].items():
            mal, rate = m["mean_acceptance_length"], m["acceptance_rate"]
            mismatches = "-" if m["mismatches"] is None else m["mismatches"]  # None: sampled, not compared
            print(f"{cell['dataset']:<10} {cell['concurrency']:>4}  {name:<12} {m['output_tok_s']:>7.1f} "
                  f"{m['speedup']:>7.2f}x {m['speedup_geomean']:>6.2f}x {_interval(m['speedup_ci95']):>13} "
                  f"{m['latency_p50_s']:>7.2f} "
                  f"{m['latency_p99_s']:>7.2f} {m['ttft_p50_s']:>8.3f} {'-' if mal is None else f'{mal:.2f}':>5} "
                  f"{'-' if rate is None else f'{rate:.2f}':>5} {mismatches:>8}")
        for name, m in cell["methods"].items():
            if name != "plain" and m.get("ttft_ratio_geomean") is not None:
                print(f"  {name} paired with plain: TTFT {m['ttft_ratio_geomean']:.3f}x "
                      f"{_interval(m['ttft_ratio_ci95'])}, latency {m['latency_ratio_geomean']:.3f}x "
                      f"{_interval(m['latency_ratio_ci95'])}, p99 wave by wave {m['latency_p99_ratio_geomean']:.3f}x "
                      f"{_interval(m['latency_p99_ratio_ci95'])}")
            if "vs_plain_sync" in m:
                r = m["vs_plain_sync"]
                print(f"  {name} over plain-sync: {r['geomean']:.3f}x {_interval(r['ci95'])}")
        together = {name: m["refills_sent_together"] for name, m in cell["methods"].items()
                    if m.get("refills_sent_together") is not None}
        if together:
            print("  refills sent together: " + ", ".join(f"{name} {v:.2f}" for name, v in together.items()))
        print(f"  noise: other processes used {cell['other_cpu_s']:.1f} CPU s over {cell['wall_s']:.1f} s "
              f"({cell['other_cores_busy']:.2f} cores busy)")


def _interval(ci: list[float | None]) -> str:
    return "-" if ci[0] is None else f"{ci[0]:.2f}-{ci[1]:.2f}x"


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(cells[0]["methods"])
    wide = len(cells) > 4  # many cells: the two panels one above the other
    fig, axes = plt.subplots(2 if wide else 1, 1 if wide else 2,
                             figsize=(max(11, 1.1 * len(cells)), 8) if wide else (11, 4))
    x = range(len(cells))
    width = 0.8 / len(methods)
    for j, name in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in x]
        speed = [c["methods"][name]["speedup"] for c in cells]
        p50 = [c["methods"][name]["latency_p50_s"] for c in cells]
        p99 = [c["methods"][name]["latency_p99_s"] for c in cells]
        cis = [c["methods"][name].get("speedup_ci95", [None, None]) for c in cells]
        err = [[max(0.0, v - (ci[0] or v)) for v, ci in zip(speed, cis)],
               [max(0.0, (ci[1] or v) - v) for v, ci in zip(speed, cis)]]
        bars = axes[0].bar(xs, speed, width, label=name, yerr=err, capsize=2)
        axes[0].bar_label(bars, labels=[f"{v:.2f}x" for v in speed], fontsize=7)
        axes[1].bar(xs, p50, width, label=f"{name} p50")
        axes[1].scatter(xs, p99, marker="_", s=200, color="black")
    for ax in axes:
        ax.set_xticks(list(x), [f"{c['dataset']}\nc={c['concurrency']}" for c in cells], fontsize=7)
    axes[0].axhline(1.0, ls="--", color="gray")
    axes[0].set_ylabel("output tok/s vs plain")
    axes[0].set_title("throughput (higher is better)")
    axes[1].set_ylabel("request latency, s (bar p50, tick p99)")
    axes[1].set_title("latency (lower is better)")
    axes[0].legend(fontsize=8)
    fig.suptitle("lookahead-vllm serving, SmolLM2-135M fp32, 2-core CPU, greedy, streaming")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from lookahead_lab.datasets import DATASETS, SPLITS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                        help="plain (required), plain-sync (async scheduling off; on a CPU, plain's twin), lookahead, lookahead:NAME (--variant), "
                             "ngram<k>[-w<min>-<max>], "
                             "suffix[-d<depth>]")
    parser.add_argument("--datasets", nargs="+", default=["humaneval"], choices=(*DATASETS, MIXED),
                        help="workload classes, each run at every concurrency (lookahead_lab.datasets); "
                             f"{MIXED!r}: all of them interleaved")
    parser.add_argument("--split", default="test", choices=SPLITS, help="the classes' split the prompts come from")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[8, 8, 16],
                        help="prompts per concurrency (one value, or one per --concurrency)")
    parser.add_argument("--waves", type=int, default=None,
                        help="waves per cell: each concurrency c takes c * DEPTH * WAVES prompts (instead of --num-prompts)")
    parser.add_argument("--depth", type=int, default=1,
                        help="requests per in-flight slot in a wave: 1 (default) sends a wave's c requests at once; "
                             "N > 1 sends c * N with at most c in flight (sustained load, one drain per wave)")
    parser.add_argument("--request-rate", type=float, default=None, metavar="R",
                        help="an open loop: each wave's c * DEPTH requests arrive at Poisson times of R a second "
                             "(seeded by the wave, the same for every method), whatever is in flight; every method "
                             "then meets the same arrivals, so latency and TTFT compare at equal load")
    parser.add_argument("--max-tokens", type=int, default=128, help="every request's max_tokens (with --vary-lengths: the highest)")
    parser.add_argument("--vary-lengths", type=int, default=None, metavar="LOW",
                        help="each request's max_tokens drawn from LOW..--max-tokens (seeded by the prompt, the same "
                             "for every method): answers end at different steps, as real traffic's do, instead of "
                             "all together at one cap")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, every text compared with plain's; T > 0: sampled at T with the "
                             "end-of-text token ignored (every method generates --max-tokens), texts not compared")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="with --temperature: the sampled requests' top_p (default 1: off)")
    parser.add_argument("--sampled-share", type=float, default=1.0, metavar="F",
                        help="with --temperature: the share of requests that sample, spread evenly in prompt order "
                             "(the rest greedy, their texts compared with plain's): greedy and sampled requests "
                             "share every step, as a mixed server's do (default 1: every request samples)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="every server's --max-model-len (the long-document prompts need ~2.6k tokens)")
    parser.add_argument("--omp-threads", type=int, default=2)
    parser.add_argument("--lookahead-config", default=None, help="JSON of lookahead fields")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="lookahead fields of method lookahead:NAME (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / f"serve_{time.strftime('%Y%m%d_%H%M%S')}.json")
    args = parser.parse_args(argv)
    if "plain" not in args.methods:
        parser.error("--methods must include plain (the reference)")
    # Lookahead fields by variant name; "" is plain lookahead's (--lookahead-config).
    args.variants = {}
    if args.lookahead_config is not None:
        try:
            args.variants[""] = json.loads(args.lookahead_config)
        except json.JSONDecodeError as e:
            parser.error(f"--lookahead-config: not JSON ({e})")
        if not isinstance(args.variants[""], dict):
            parser.error(f"--lookahead-config {args.lookahead_config!r}: expected a JSON object")
    for spec in args.variant:
        name, sep, fields = spec.partition("=")
        try:
            args.variants[name] = json.loads(fields) if sep and name else None
        except json.JSONDecodeError as e:
            parser.error(f"--variant {spec!r}: not JSON ({e})")
        if not isinstance(args.variants[name], dict):
            parser.error(f"--variant {spec!r}: expected NAME=JSON object")
    for method in args.methods:
        try:
            method_flags(method, args.variants)
        except ValueError as e:
            parser.error(f"--methods {method!r}: {e}")
    if len(set(args.methods)) != len(args.methods):
        parser.error(f"--methods {args.methods}: each method once")
    if any(m.startswith("suffix") for m in args.methods) and importlib.util.find_spec("arctic_inference") is None:
        parser.error("--methods 'suffix': needs arctic_inference.suffix_decoding; install it with scripts/setup.sh")
    if args.depth < 1:
        parser.error(f"--depth {args.depth}: must be >= 1")
    if args.waves is not None:
        if args.waves < 1:
            parser.error(f"--waves {args.waves}: must be >= 1")
        args.num_prompts = [c * args.depth * args.waves for c in args.concurrency]
    for name in ("concurrency", "num_prompts"):
        if any(v < 1 for v in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: every value must be >= 1")
    if len(args.num_prompts) not in (1, len(args.concurrency)):
        parser.error(f"--num-prompts {args.num_prompts}: one value, or one per --concurrency ({len(args.concurrency)})")
    for name, low in (("max_tokens", 1), ("max_model_len", 16), ("omp_threads", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {low}")
    if not 0 <= args.temperature <= 2:
        parser.error(f"--temperature {args.temperature}: must be in [0, 2]")
    if not 0 < args.top_p <= 1 or (args.top_p < 1 and not args.temperature):
        parser.error(f"--top-p {args.top_p}: must be in (0, 1], and below 1 only with --temperature > 0")
    if not 0 < args.sampled_share <= 1:
        parser.error(f"--sampled-share {args.sampled_share}: must be in (0, 1]")
    if args.sampled_share < 1 and not args.temperature:
        parser.error(f"--sampled-share {args.sampled_share}: needs --temperature > 0 (a share of requests that sample)")
    if args.request_rate is not None and not args.request_rate > 0:
        parser.error(f"--request-rate {args.request_rate}: must be > 0 requests a second")
    if args.vary_lengths is not None and not 1 <= args.vary_lengths <= args.max_tokens:
        parser.error(f"--vary-lengths {args.vary_lengths}: must be within 1..--max-tokens ({args.max_tokens})")
    args.counts = args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 else args.num_prompts
    return args


def round_robin(classes: list[list[Any]]) -> list[Any]:
    """The classes' items interleaved round robin (a class that runs out drops out)."""
    return [c[i] for i in range(max(map(len, classes))) for c in classes if i < len(c)]


def mixed_split(split: str, tokenizer: Any) -> list[str]:
    """Every class's ``split`` interleaved round robin (``serve_by_class.py`` reads the classes back)."""
    from lookahead_lab.datasets import DATASETS, load_split

    return round_robin([load_split(d, split, tokenizer) for d in DATASETS])


def workload_prompts(args: argparse.Namespace, tokenizer: Any) -> dict[str, list[str]]:
    """Chat-formatted prompts of every dataset's split, as many as all its cells take (each
    concurrency's cell gets the next ones: no request repeats an earlier cell's);
    ``SystemExit`` naming the dataset where the split holds fewer or one is too long."""
    from lookahead_lab.datasets import load_split

    need = sum(args.counts)
    prompts = {}
    for dataset in args.datasets:
        prompts[dataset] = (mixed_split(args.split, tokenizer) if dataset == MIXED
                            else load_split(dataset, args.split, tokenizer, need))[:need]
        if len(prompts[dataset]) < need:
            raise SystemExit(f"--num-prompts {need}: {dataset}'s {args.split} split holds {len(prompts[dataset])}")
        longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts[dataset])
        if longest + args.max_tokens > args.max_model_len:
            raise SystemExit(f"--max-model-len {args.max_model_len}: {dataset} has a {longest}-token prompt, "
                             f"plus --max-tokens {args.max_tokens}")
    return prompts


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (s) of a Poisson process of ``rate`` per second, the first at 0, seeded."""
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


def length_caps(prompts: list[str], args: argparse.Namespace) -> list[int]:
    """Each prompt's max_tokens: ``--max-tokens``, or with ``--vary-lengths LOW`` a draw from
    LOW..--max-tokens seeded by the prompt's text (so a prompt gets one cap in every cell and run)."""
    if args.vary_lengths is None:
        return [args.max_tokens] * len(prompts)
    return [random.Random(zlib.crc32(p.encode())).randint(args.vary_lengths, args.max_tokens) for p in prompts]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    from transformers import AutoTokenizer

    from lookahead_vllm.models import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = workload_prompts(args, tokenizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    print(f"server logs: {log_dir}", file=sys.stderr)
    # A SIGTERM (a `timeout` wrapper, a job scheduler) stops the servers in `finally` as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    servers = start_servers(model, args.methods, args, log_dir)
    started = time.time()
    cells = []
    try:
        # Untimed warm-up (one short request each; the lookahead trie learns nothing it reuses).
        for s in servers:
            asyncio.run(run_wave(s, ["Hello, my name is"], 8))
        for dataset in args.datasets:
            first = 0
            for c, n in zip(args.concurrency, args.counts):
                print(f"{dataset}, concurrency {c}: prompts {first}..{first + n - 1}", file=sys.stderr, flush=True)
                cell_prompts = prompts[dataset][first:first + n]
                caps = length_caps(cell_prompts, args)
                temps = sampling_temperatures(len(cell_prompts), args.temperature, args.sampled_share)
                cell = run_cell(servers, cell_prompts, c, caps, args.depth, args.request_rate, temps, args.top_p)
                cells.append(summarize(cell, c, dataset, args.depth))
                cells[-1]["sampled_requests"] = len(cell.sampled)
                if args.vary_lengths is not None:
                    cells[-1]["max_tokens"] = caps
                cells[-1]["prompt_tokens"] = [len(tokenizer(p, add_special_tokens=False)["input_ids"])
                                              for p in cell_prompts]
                first += n
                # After every cell, so a run cut off (a time limit, a crash) keeps what it measured.
                args.out.write_text(json.dumps({"partial": True, "args": {k: str(v) for k, v in vars(args).items()},
                                                "cells": cells}, indent=2))
    finally:
        stop_servers(servers)
    result = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_end": os.getloadavg()},
        "git": _git(),
        "cells": cells,
    }
    print_table(cells)
    args.out.write_text(json.dumps(result, indent=2))
    png = args.out.with_suffix(".png")
    plot(cells, png)
    if args.out.parent.resolve() == RESULTS.resolve():
        shutil.copy(args.out, RESULTS / "serve_latest.json")
        shutil.copy(png, RESULTS / "serve_latest.png")
    print(f"wrote {args.out} and {png}", file=sys.stderr)


def _git() -> dict[str, Any]:
    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO).stdout.strip()

    return {"commit": run("git", "rev-parse", "HEAD"), "dirty": bool(run("git", "status", "--porcelain"))}


if __name__ == "__main__":
    main()
