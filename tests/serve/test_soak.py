"""A short soak of the OpenAI server: mixed traffic, and nothing left behind.

The same seeded traffic (``benchmarks/bench_soak.py``: completions and chat,
streamed or not, streams cut off by the client, greedy and sampled, lookahead
off per request, prompts near ``max_model_len``, and one request per
out-of-range field) goes to the session's plain and lookahead servers at once.
Then: no errors, greedy texts identical to plain, every bad field a 400 that
names it, both servers alive, the drafter holds no request state once the
engine drained (``lookahead_request_states`` on /metrics, which was above 0
while requests ran), and the server's resident memory stays under a cap.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.vllm

NUM_REQUESTS = 28  # plus one per bad field
CONCURRENCY = 3  # below the session lookahead server's load_stop_at (4): drafting stays on
MAX_TOKENS = 24
SEED = 18
# The lookahead server's process tree may grow this much over the soak, and be
# at most this much larger than the plain server's.
MAX_RSS_GROWTH = 0.10
MAX_RSS_VS_PLAIN = 1.20


def _bench():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        return __import__("bench_soak")
    finally:
        sys.path.pop(0)


bench = _bench()


@pytest.fixture(scope="module")
def traffic(smollm2_dir):
    from transformers import AutoTokenizer

    mix = bench.Mix(stream=0.5, disconnect=0.3, sampled=0.3, lookahead_off=0.15, long=0.12, bad=0.0)
    from lookahead_vllm.serve import is_cpu_install

    reqs = bench.make_traffic(NUM_REQUESTS, SEED, AutoTokenizer.from_pretrained(smollm2_dir), MAX_MODEL_LEN,
                              MAX_TOKENS, mix, seeded=not is_cpu_install())
    reqs += bench.bad_field_requests(len(reqs), "def fib(n):", 4)
    # The seed covers every kind of request (else the assertions below prove less).
    assert any(r.long for r in reqs) and any(r.disconnect_after for r in reqs)
    assert any(r.lookahead_off and r.greedy for r in reqs) and any(not r.greedy for r in reqs)
    assert {r.api for r in reqs} == {"chat", "completions"}
    return reqs


class GaugeWatcher:
    """Polls the lookahead server's ``lookahead_request_states`` while the soak runs; keeps the maximum."""

    def __init__(self, url: str) -> None:
        self.max = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(url,), daemon=True)
        self._thread.start()

    def _loop(self, url: str) -> None:
        while not self._stop.wait(0.3):
            self.max = max(self.max, bench.scrape(url).get("lookahead_request_states", 0.0))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.max


@pytest.fixture(scope="module")
def soak(plain, lookahead, traffic):
    servers = {"plain": plain, "lookahead": lookahead}
    rss_before = {n: bench.tree_rss_bytes(s.proc.pid) for n, s in servers.items()}
    watcher = GaugeWatcher(lookahead.url)
    deadline = time.monotonic() + 300

    def run(server):
        return asyncio.run(bench.run_requests(server.url, server.model, traffic, CONCURRENCY, deadline))

    with ThreadPoolExecutor(2) as pool:  # both servers at once, one core each
        futures = {n: pool.submit(run, s) for n, s in servers.items()}
        outcomes = {n: f.result() for n, f in futures.items()}
    gauge_max = watcher.stop()
    drained = bench.drained_metrics(lookahead.url)
    return {
        "outcomes": outcomes,
        "summary": bench.summarize(traffic, outcomes),
        "gauge_max": gauge_max,
        "drained": drained,
        "rss_before": rss_before,
        "rss_after": {n: bench.tree_rss_bytes(s.proc.pid) for n, s in servers.items()},
    }


def test_no_errors_and_every_request_answered(soak, traffic):
    for name, s in soak["summary"].items():
        assert s["errors"] == 0, f"{name}: {s['error_samples']}"
        assert s["requests"] == len(traffic)
        # A stream shorter than its cut-off point ends normally; the others were cut.
        assert 1 <= s["disconnected"] <= sum(r.disconnect_after is not None for r in traffic)


def test_greedy_texts_identical_to_plain(soak, traffic):
    la = soak["summary"]["lookahead"]
    greedy_ok = [r for r in traffic if r.greedy and r.bad_field is None and r.disconnect_after is None]
    assert la["greedy_compared"] == len(greedy_ok)
    assert la["greedy_mismatches"] == 0, f"mismatched requests {la['mismatch_indices']}"
    assert la["long_prompts_ok"] == sum(r.long for r in traffic if r.disconnect_after is None)


def test_every_bad_field_is_a_400_naming_it(soak, traffic):
    bad = [r for r in traffic if r.bad_field is not None]
    assert {r.bad_field for r in bad} == {name for name, _ in bench.BAD_FIELDS}
    for name, outs in soak["outcomes"].items():
        by_index = {o.index: o for o in outs}
        for r in bad:
            o = by_index[r.index]
            assert (o.status, o.http_status) == ("bad_400", 400), f"{name} {r.bad_field}: {o.detail}"


def test_no_request_state_left_after_the_drain(soak, plain, lookahead):
    assert soak["gauge_max"] > 0  # the gauge is live: it counted the running requests
    assert soak["drained"]["vllm:num_requests_running"] == 0
    assert soak["drained"]["lookahead_request_states"] == 0
    assert bench.healthy(plain.url) and bench.healthy(lookahead.url)


def test_resident_memory_under_cap(soak):
    before, after = soak["rss_before"], soak["rss_after"]
    assert after["lookahead"] <= before["lookahead"] * (1 + MAX_RSS_GROWTH), (before, after)
    assert after["lookahead"] <= after["plain"] * MAX_RSS_VS_PLAIN, after


def test_request_states_gauge_follows_the_owner(tmp_path):
    """The publisher reads ``num_request_states()`` itself (no engine step needed); a dead owner reads 0."""
    import gc
    import os
    import weakref

    import prometheus_client

    from lookahead_vllm.vllm import metrics

    class Owner:
        states = 3

        def num_request_states(self) -> int:
            return self.states

    owner, stats = Owner(), metrics.StepStats()
    method = weakref.WeakMethod(owner.num_request_states)
    metrics.write_snapshot(str(tmp_path / f"{os.getpid()}-0.json"), metrics.snapshot_with_states(stats, method))
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.StatsCollector(str(tmp_path)))
    assert registry.get_sample_value("lookahead_request_states") == 3
    owner.states = 0
    metrics.write_snapshot(str(tmp_path / f"{os.getpid()}-0.json"), metrics.snapshot_with_states(stats, method))
    assert registry.get_sample_value("lookahead_request_states") == 0
    del owner
    gc.collect()
    assert metrics.snapshot_with_states(stats, method)["request_states"] == 0
