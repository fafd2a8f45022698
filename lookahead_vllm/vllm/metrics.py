"""Lookahead's Prometheus ``lookahead_*`` series (the README's metrics table) and periodic log line: each proposer's
:class:`StatsPublisher` (tensor-parallel rank 0) writes JSON snapshots of its :class:`StepStats` into
``$LOOKAHEAD_VLLM_STATS_DIR``, summed by the API server's :class:`StatsCollector` at each scrape."""

from __future__ import annotations

import atexit
import bisect
import contextlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

STATS_DIR_ENV = "LOOKAHEAD_VLLM_STATS_DIR"
PUBLISH_INTERVAL_S = 0.5
FINAL_SUFFIX = ".final"  # a stopped publisher's last snapshot: its file name plus this
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
TOKENS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
SKIP_REASONS = ("request", "load", "cost")

_counter = itertools.count()
_setup_done = False
_collector: "StatsCollector | None" = None  # this process's, once setup_process registered it


@dataclass(slots=True)
class Histogram:
    """``counts[i]``: observations <= ``bounds[i]`` and above the bound before (last: +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.total += value
        self.counts[bisect.bisect_left(self.bounds, value)] += 1


@dataclass(slots=True)
class StepStats:
    """What one proposer publishes; mutated by the proposer's thread only."""

    trie_nodes: int = 0
    drafter_bytes: int = 0
    load_budget: int = 0
    # The forward-cost model's live prices (core/prices.py); source: "pinned", "prior" or "fitted".
    price_free_tokens: int = 0
    price_marginal_tokens: float = 0.0
    price_draft_setup: float = 0.0
    price_row: float = 0.0
    price_context: float = 0.0
    price_step_seconds: float = 0.0
    price_samples: int = 0
    price_source: str = "pinned"
    # Tenant isolation (core/partitions.py): the policy, the partitions held and the corpus's charge.
    draft_sharing: str = ""
    draft_partitions: int = 0
    corpus_bytes: int = 0
    steps: int = 0
    draftless_steps: int = 0  # steps with no draft token in the batch, run as plain decoding
    draft_tokens: int = 0
    accepted_tokens: int = 0  # a row that returns m sampled tokens accepted m - 1 drafts
    skipped_request_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    drafter_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    draft_tokens_per_step: Histogram = field(default_factory=lambda: Histogram(TOKENS_BUCKETS))
    accepted_tokens_per_step: Histogram = field(default_factory=lambda: Histogram(TOKENS_BUCKETS))

    def record_step(self, draft_tokens: int, accepted: int, seconds: float, skipped: dict[str, int]) -> None:
        self.steps += 1
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        for reason, n in skipped.items():
            self.skipped_request_steps[reason] += n
        self.drafter_seconds.observe(seconds)
        self.draft_tokens_per_step.observe(draft_tokens)
        self.accepted_tokens_per_step.observe(accepted)

    def set_prices(self, cost: Any, source: str, step_seconds: float = 0.0, samples: int = 0) -> None:
        """The prices of ``cost`` (a budget.ForwardCost) are live from now on."""
        self.price_free_tokens, self.price_marginal_tokens = cost.free_tokens, cost.marginal_tokens
        self.price_draft_setup, self.price_row, self.price_context = cost.draft_setup, cost.per_row, cost.per_context
        self.price_step_seconds, self.price_samples, self.price_source = step_seconds, samples, source

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)


class IntervalLogger:
    """One INFO line per interval, like vLLM's ``SpecDecoding metrics`` line."""

    def __init__(self, logger: Any, interval_s: float) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last_t = time.monotonic()
        self._last = (0, 0, 0, 0.0)  # steps, draft tokens, accepted, drafter seconds

    def maybe_log(self, stats: StepStats) -> None:
        now = time.monotonic()
        if now - self._last_t < self.interval_s:
            return
        cur = (stats.steps, stats.draft_tokens, stats.accepted_tokens, stats.drafter_seconds.total)
        steps = cur[0] - self._last[0]
        self._last_t, last, self._last = now, self._last, cur
        if steps <= 0:
            return
        self.logger.info(
            "lookahead: drafted %.2f nodes/step, accepted %.2f tok/step, trie %d nodes, drafter memory %.1f MiB, "
            "drafter %.3f ms/step, load budget %d nodes/request, token prices %d free + 1 forward per %.1f, "
            "draft setup %.3f, row %.3f, context %.3f/1k forwards (%s, %d samples)",
            (cur[1] - last[1]) / steps, (cur[2] - last[2]) / steps, stats.trie_nodes,
            stats.drafter_bytes / 2**20, (cur[3] - last[3]) * 1e3 / steps, stats.load_budget,
            stats.price_free_tokens, stats.price_marginal_tokens, stats.price_draft_setup, stats.price_row,
            stats.price_context, stats.price_source, stats.price_samples)


class StatsPublisher:
    """Daemon thread writing ``stats.snapshot()``, with the owner's ``num_request_states()`` read by this thread (so
    it falls to 0 after a drain with no engine step after it), every PUBLISH_INTERVAL_S."""

    def __init__(self, owner: object, stats: StepStats) -> None:
        self.path = None
        directory = os.environ.get(STATS_DIR_ENV)
        if not directory or not os.path.isdir(directory) or tp_rank() != 0:
            return
        self.path = os.path.join(directory, f"{os.getpid()}-{next(_counter)}.json")
        stop = threading.Event()
        states = weakref.WeakMethod(owner.num_request_states) if hasattr(owner, "num_request_states") else None
        instance = uuid.uuid4().hex  # tells this publisher from a later one under its file name (a reused pid)
        threading.Thread(target=_publish_loop, args=(self.path, stats, stop, states, instance),
                         name="lookahead-stats", daemon=True).start()
        weakref.finalize(owner, _stop_publishing, stop, self.path, stats, instance)


def _publish_loop(path: str, stats: StepStats, stop: threading.Event, states: Any, instance: str) -> None:
    while not stop.wait(PUBLISH_INTERVAL_S):
        write_snapshot(path, {**snapshot_with_states(stats, states), "publisher": instance})
    _remove_files(path)  # again: a write that raced the owner's removal may have put the file back


def snapshot_with_states(stats: StepStats, states: Any = None) -> dict[str, Any]:
    """``stats.snapshot()`` plus ``request_states`` from the (weak) ``num_request_states`` method."""
    count = states() if states is not None else None
    return {**stats.snapshot(), "request_states": int(count()) if count is not None else 0}


def write_snapshot(path: str, snapshot: dict[str, Any]) -> None:
    """Write ``snapshot`` to ``path`` atomically (write, then rename)."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(OSError):  # the directory went away at shutdown
        with open(tmp, "w") as f:
            json.dump(snapshot, f)
        os.replace(tmp, path)


def _stop_publishing(stop: threading.Event, path: str, stats: StepStats, instance: str) -> None:
    # The owner gone: its final counts first (the stopped thread removes the live file; a scrape must find one).
    write_snapshot(path + FINAL_SUFFIX, {**snapshot_with_states(stats), "publisher": instance})
    stop.set()
    _remove_files(path)


def _remove_files(path: str) -> None:
    for p in (path, f"{path}.tmp"):
        with contextlib.suppress(OSError):
            os.remove(p)


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 without distributed state)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no distributed state (unit tests): single rank
        return 0


def read_final_snapshots(directory: str, since: float, seen: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Stopped publishers' final snapshots not read before (``seen``: final's name -> mtime read; updated), by live
    file name. They stay for every API server's collector; one older than ``since`` (an earlier server's) is removed."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json" + FINAL_SUFFIX):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError, ValueError):
            info = os.stat(path)
            if info.st_mtime < since:
                os.remove(path)
            elif seen.get(name) != info.st_mtime_ns:
                with open(path) as f:
                    out[name.removesuffix(FINAL_SUFFIX)] = json.load(f)
                seen[name] = info.st_mtime_ns
    return out


def read_snapshots(directory: str) -> dict[str, dict[str, Any] | None]:
    """Snapshots of live processes by file name (None: listed, but unreadable this time)."""
    out: dict[str, dict[str, Any] | None] = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json") or not _alive(name.split("-", 1)[0]):
            continue
        out[name] = None
        with contextlib.suppress(OSError, ValueError), open(os.path.join(directory, name)) as f:
            out[name] = json.load(f)
    return out


# (name, snapshot key, help). GAUGES: live publishers' sums (``price_*``, ``load_budget``: means); BY_POLICY's per
# draft_sharing policy (label ``sharing``); COUNTERS, HISTOGRAMS, skip reasons: cumulative, departed publishers' kept.
GAUGES = (
    ("lookahead_trie_nodes", "trie_nodes", "Nodes in the lookahead token trie."),
    ("lookahead_drafter_bytes", "drafter_bytes", "Estimated drafter memory (index, trie, Jacobi table), bytes."),
    ("lookahead_load_budget", "load_budget", "Draft nodes per request after load adaptation."),
    ("lookahead_request_states", "request_states", "Requests the lookahead drafter holds state for."),
    ("lookahead_price_free_tokens", "price_free_tokens",
     "Tokens a forward scores for the price of one (forward-cost model, live)."),
    ("lookahead_price_marginal_tokens", "price_marginal_tokens",
     "Tokens past the free ones that cost one more forward (forward-cost model, live)."),
    ("lookahead_price_draft_setup", "price_draft_setup",
     "Forwards a step with drafts costs over one without (forward-cost model, live)."),
    ("lookahead_price_row", "price_row",
     "Forwards each row of a step past the first adds, whatever its tokens (forward-cost model, live)."),
    ("lookahead_price_context", "price_context",
     "Forwards a row with drafts adds per 1000 tokens of its context (forward-cost model, live)."),
    ("lookahead_price_step_seconds", "price_step_seconds", "Fitted step seconds within the free tokens (0: unfitted)."),
    ("lookahead_price_samples", "price_samples", "Step-time samples the live token prices rest on."))
BY_POLICY = (
    ("lookahead_draft_partitions", "draft_partitions",
     "Draft index partitions holding a request or an output, by draft_sharing policy."),
    ("lookahead_corpus_bytes", "corpus_bytes",
     "Draft index corpus charge over all partitions (capped by index_corpus_bytes), bytes."))
COUNTERS = (
    ("lookahead_steps", "steps", "Engine steps in which the lookahead drafter ran."),
    ("lookahead_draftless_steps", "draftless_steps", "Steps with no draft token in the batch, run as plain decoding."),
    ("lookahead_draft_tokens", "draft_tokens", "Draft nodes handed to vLLM by lookahead."),
    ("lookahead_accepted_tokens", "accepted_tokens", "Lookahead draft tokens accepted by the target."))
HISTOGRAMS = (
    ("lookahead_drafter_seconds", "drafter_seconds", "Lookahead drafter wall time per engine step."),
    ("lookahead_draft_tokens_per_step", "draft_tokens_per_step", "Lookahead draft nodes per engine step."),
    ("lookahead_accepted_tokens_per_step", "accepted_tokens_per_step", "Accepted draft tokens per engine step."))


def add_cumulative(into: dict[str, Any], snap: dict[str, Any], sign: int = 1) -> None:
    """Add ``snap``'s cumulative parts to ``into`` (same layout; empty to start); ``sign`` -1 takes them away."""
    for _, key, _ in COUNTERS:
        into[key] = into.get(key, 0) + sign * snap.get(key, 0)
    skipped = into.setdefault("skipped_request_steps", dict.fromkeys(SKIP_REASONS, 0))
    for reason in SKIP_REASONS:
        skipped[reason] += sign * snap.get("skipped_request_steps", {}).get(reason, 0)
    for _, key, _ in HISTOGRAMS:
        hist = snap.get(key)
        if hist is None:
            continue
        mine = into.setdefault(key, {"bounds": hist["bounds"], "counts": [0] * len(hist["counts"]), "total": 0.0})
        mine["counts"] = [a + sign * b for a, b in zip(mine["counts"], hist["counts"])]
        mine["total"] += sign * hist["total"]


def _clock_of(directory: str) -> float:
    """Now, as ``directory``'s file system stamps a modification time (``time.time()`` where it cannot)."""
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".clock-") as f:
            return os.fstat(f.fileno()).st_mtime
    except OSError:
        return time.time()


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True


class StatsCollector:
    """``prometheus_client`` collector summing the snapshots into ``lookahead_*`` families. Counters and histograms
    never fall (Prometheus would read a reset): a publisher gone keeps its final (or last seen) snapshot's counts."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._last: dict[str, dict[str, Any]] = {}  # file name -> its snapshot at the last scrape
        self._gone: dict[str, Any] = {}  # cumulative parts of the publishers gone since (add_cumulative)
        # (file name, publisher) of those -> its snapshot counted: a file that comes back (a reused pid) is not
        # counted again, and the final of one retired from its last-seen snapshot adds only what it counted since.
        self._retired: dict[tuple[str, str], dict[str, Any]] = {}
        self._since = _clock_of(directory)  # finals older than this are an earlier server's
        self._finals_read: dict[str, int] = {}  # read_final_snapshots' ``seen``
        self._finals_counted: set[tuple[str, str]] = set()  # (file name, publisher) of the finals counted
        self._lock = threading.Lock()  # scrapes may come on several threads

    def describe(self) -> list:
        return []  # unchecked collector: nothing is read at registration

    def collect(self) -> Iterator[Any]:
        with self._lock:
            families = list(self._families())
        yield from families

    def _families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        found = os.path.isdir(self.directory)
        # Live files first: a publisher stopping in between is seen live now or by its final, never by neither.
        live = read_snapshots(self.directory) if found else {}
        finals = read_final_snapshots(self.directory, self._since, self._finals_read) if found else {}
        for name, final in finals.items():  # stopped publishers: their last counts, exactly
            key = (name, final.get("publisher", ""))
            if key in self._finals_counted:  # its file rewritten: counted once
                continue
            self._finals_counted.add(key)
            counted = self._retired.get(key)
            add_cumulative(self._gone, final)
            if counted is not None:  # retired from its last-seen snapshot (its file gone before the final came)
                add_cumulative(self._gone, counted, -1)
            elif self._last.get(name, {}).get("publisher", "") == key[1]:
                del self._last[name]  # counted by its final snapshot, not by its last seen here
            self._retired[key] = final
        live = {name: snap for name, snap in live.items()
                if snap is None or (name, snap.get("publisher", "")) not in self._retired}
        for name, last in self._last.items():
            now = live.get(name, last)
            if name not in live or (now is not None and now.get("publisher") != last.get("publisher")):
                add_cumulative(self._gone, last)  # gone, or another publisher under its name
                self._retired[(name, last.get("publisher", ""))] = last
            elif now is None:
                live[name] = last  # listed but unreadable this time: its last snapshot still counts
        self._last = {name: snap for name, snap in live.items() if snap is not None}
        snaps = list(self._last.values())
        if not snaps and not self._gone:
            return
        counted: dict[str, Any] = {}  # counters and histograms: the publishers gone since too
        for snap in [*snaps, self._gone]:
            add_cumulative(counted, snap)
        for name, key, doc in GAUGES:
            total, mean = sum(s.get(key, 0) for s in snaps), key.startswith("price_") or key == "load_budget"
            yield GaugeMetricFamily(name, doc, value=total / max(1, len(snaps)) if mean else total)
        for name, key, doc in BY_POLICY:
            gauge, by_policy = GaugeMetricFamily(name, doc, labels=["sharing"]), Counter()
            for snap in snaps:
                by_policy[snap.get("draft_sharing") or "per-salt"] += snap.get(key, 0)
            for policy, value in sorted(by_policy.items()):
                gauge.add_metric([policy], value)
            yield gauge
        for name, key, doc in COUNTERS:
            yield CounterMetricFamily(name, doc, value=counted[key])
        skipped = CounterMetricFamily("lookahead_skipped_request_steps", "Request-steps not drafted, by reason.",
                                      labels=["reason"])
        for reason in SKIP_REASONS:
            skipped.add_metric([reason], counted["skipped_request_steps"][reason])
        yield skipped
        for name, key, doc in HISTOGRAMS:
            hist = counted[key]
            cumulative = list(itertools.accumulate(hist["counts"]))
            buckets = [(str(float(b)), c) for b, c in zip(hist["bounds"], cumulative)] + [("+Inf", cumulative[-1])]
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist["total"])


def setup_process() -> None:
    """Once per process, never retried: the stats directory (made by the first process) and the collector registered."""
    global _setup_done, _collector
    if _setup_done:
        return
    _setup_done = True
    directory = os.environ.get(STATS_DIR_ENV)
    if not directory:
        directory = tempfile.mkdtemp(prefix="lookahead-vllm-stats-")
        os.environ[STATS_DIR_ENV] = directory
        atexit.register(shutil.rmtree, directory, True)
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    _collector = StatsCollector(directory)
    REGISTRY.register(_collector)


def export_to(registry: Any) -> None:
    """Also export the ``lookahead_*`` series through ``registry`` (serve_patches.patch_multiprocess_metrics)."""
    if _collector is not None:
        registry.register(_collector)
