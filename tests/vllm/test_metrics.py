"""lookahead_* Prometheus series: snapshots written by the engine side, summed by the collector."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
prometheus_client = pytest.importorskip("prometheus_client")

from lookahead_vllm.vllm import metrics  # noqa: E402


def _scrape(directory) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.StatsCollector(str(directory)))
    text = prometheus_client.generate_latest(registry).decode()
    return {
        s.name + (f"{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}" if s.labels else ""): s.value
        for fam in text_string_to_metric_families(text) for s in fam.samples
    }


def test_snapshots_of_live_processes_are_summed(tmp_path):
    a, b = metrics.StepStats(trie_nodes=10, drafter_bytes=2000), metrics.StepStats(trie_nodes=5, drafter_bytes=1000)
    a.record_step(draft_tokens=6, accepted=4, seconds=0.0003, skipped={"request": 1, "load": 0})
    a.record_step(draft_tokens=0, accepted=0, seconds=0.00005, skipped={"request": 0, "load": 2})
    b.record_step(draft_tokens=3, accepted=3, seconds=0.02, skipped={"request": 0, "load": 0})
    metrics.write_snapshot(str(tmp_path / f"{os.getpid()}-0.json"), a.snapshot())
    metrics.write_snapshot(str(tmp_path / f"{os.getpid()}-1.json"), b.snapshot())
    metrics.write_snapshot(str(tmp_path / "999999999-0.json"), a.snapshot())  # dead process: ignored
    got = _scrape(tmp_path)
    assert got["lookahead_trie_nodes"] == 15 and got["lookahead_drafter_bytes"] == 3000
    assert got["lookahead_steps_total"] == 3
    assert got["lookahead_draft_tokens_total"] == 9 and got["lookahead_accepted_tokens_total"] == 7
    assert got["lookahead_skipped_request_steps_total{reason=request}"] == 1
    assert got["lookahead_skipped_request_steps_total{reason=load}"] == 2
    assert got["lookahead_drafter_seconds_count"] == 3
    assert got["lookahead_drafter_seconds_sum"] == pytest.approx(0.02035)
    assert got["lookahead_drafter_seconds_bucket{le=0.0001}"] == 1
    assert got["lookahead_drafter_seconds_bucket{le=0.0005}"] == 2
    assert got["lookahead_draft_tokens_per_step_bucket{le=0.0}"] == 1
    assert got["lookahead_draft_tokens_per_step_bucket{le=4.0}"] == 2
    assert got["lookahead_draft_tokens_per_step_bucket{le=+Inf}"] == 3


def test_counters_never_fall_when_a_publisher_goes_away(tmp_path, monkeypatch):
    """A publisher's file removed (its proposer shut down), unreadable for a scrape, taken over by
    another publisher (a reused process id), or its process dead: the counters and histograms keep
    what each counted and count nothing twice (Prometheus reads a fall as a reset); gauges drop it."""
    from prometheus_client.parser import text_string_to_metric_families

    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.StatsCollector(str(tmp_path)))  # one collector across scrapes, as in a server

    def scrape() -> dict[str, float]:
        text = prometheus_client.generate_latest(registry).decode()
        return {s.name + (f"{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}" if s.labels else ""):
                s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    def publish(path, stats, instance):
        metrics.write_snapshot(str(path), {**stats.snapshot(), "publisher": instance})

    a, b = metrics.StepStats(trie_nodes=10), metrics.StepStats(trie_nodes=5)
    a.record_step(draft_tokens=6, accepted=4, seconds=0.0003, skipped={"request": 1, "load": 0})
    b.record_step(draft_tokens=3, accepted=3, seconds=0.02, skipped={"request": 0, "load": 2})
    path_a, path_b = tmp_path / f"{os.getpid()}-0.json", tmp_path / f"{os.getpid()}-1.json"
    publish(path_a, a, "a")
    publish(path_b, b, "b")
    assert scrape()["lookahead_draft_tokens_total"] == 9
    read = metrics.json.load
    with monkeypatch.context() as m:  # a's file unreadable for one scrape (say, no file handle left)
        m.setattr(metrics.json, "load", lambda f: read(f) if "-1.json" in f.name else int("x"))
        assert scrape()["lookahead_draft_tokens_total"] == 9
    assert scrape()["lookahead_draft_tokens_total"] == 9  # readable again: not counted twice
    path_b.unlink()  # b's proposer went away
    second = scrape()
    assert second["lookahead_draft_tokens_total"] == 9 and second["lookahead_steps_total"] == 2
    assert second["lookahead_skipped_request_steps_total{reason=load}"] == 2
    assert second["lookahead_drafter_seconds_count"] == 2 and second["lookahead_trie_nodes"] == 10
    c = metrics.StepStats(trie_nodes=1)
    c.record_step(draft_tokens=1, accepted=0, seconds=0.0003, skipped={"request": 0, "load": 0})
    publish(path_b, c, "c")  # a new publisher under b's old name
    assert scrape()["lookahead_draft_tokens_total"] == 10
    dead = tmp_path / "999999999-0.json"
    path_a.rename(dead)  # a's process died: its file is skipped from now on
    assert scrape()["lookahead_draft_tokens_total"] == 10
    dead.rename(path_a)  # ... until its process id is reused: the stale file is not counted twice
    third = scrape()
    assert third["lookahead_draft_tokens_total"] == 10 and third["lookahead_trie_nodes"] == 1  # c alone is live
    path_b.rename(tmp_path / "999999999-1.json")
    last = scrape()
    assert last["lookahead_draft_tokens_total"] == 10 and last["lookahead_trie_nodes"] == 0  # no live publisher


def test_live_prices_are_averaged_over_processes(tmp_path):
    a, b = metrics.StepStats(), metrics.StepStats()
    a.set_prices(SimpleNamespace(free_tokens=8, marginal_tokens=30.0, draft_setup=0.1, per_row=0.06,
                                 per_context=0.1), "fitted", 0.04,
                 200)
    b.set_prices(SimpleNamespace(free_tokens=4, marginal_tokens=10.0, draft_setup=0.0, per_row=0.02,
                                 per_context=0.0), "prior")
    metrics.write_snapshot(str(tmp_path / f"{os.getpid()}-0.json"), a.snapshot())
    metrics.write_snapshot(str(tmp_path / f"{os.getpid()}-1.json"), b.snapshot())
    got = _scrape(tmp_path)
    assert got["lookahead_price_free_tokens"] == 6 and got["lookahead_price_marginal_tokens"] == 20
    assert got["lookahead_price_step_seconds"] == pytest.approx(0.02) and got["lookahead_price_samples"] == 100
    assert got["lookahead_price_draft_setup"] == pytest.approx(0.05)
    assert got["lookahead_price_row"] == pytest.approx(0.04)
    assert got["lookahead_price_context"] == pytest.approx(0.05)


def test_the_load_budget_is_averaged_over_processes(tmp_path):
    """A request's node budget after load adaptation: two engines at 8 each report 8, not 16 (the trie sums)."""
    for i, budget in enumerate((8, 8)):
        snap = metrics.StepStats(load_budget=budget, trie_nodes=100).snapshot()
        metrics.write_snapshot(str(tmp_path / f"{os.getpid()}-{i}.json"), {**snap, "publisher": f"p{i}"})
    got = _scrape(tmp_path)
    assert got["lookahead_load_budget"] == 8 and got["lookahead_trie_nodes"] == 200


def test_no_snapshot_no_series(tmp_path):
    assert not any(k.startswith("lookahead_") for k in _scrape(tmp_path))


def test_interval_logger_reports_per_step_means():
    lines = []

    class Log:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    stats = metrics.StepStats(trie_nodes=100, drafter_bytes=3 * 2**20, load_budget=8)
    stats.set_prices(SimpleNamespace(free_tokens=12, marginal_tokens=40.5, draft_setup=0.05, per_row=0.04,
                                     per_context=0.08), "fitted",
                     0.02, 320)
    log = metrics.IntervalLogger(Log(), interval_s=0.0)
    stats.record_step(draft_tokens=8, accepted=6, seconds=0.001, skipped={})
    stats.record_step(draft_tokens=4, accepted=0, seconds=0.003, skipped={})
    log.maybe_log(stats)
    assert lines == [
        "lookahead: drafted 6.00 nodes/step, accepted 3.00 tok/step, trie 100 nodes, drafter memory 3.0 MiB, "
        "drafter 2.000 ms/step, load budget 8 nodes/request, token prices 12 free + 1 forward per 40.5, "
        "draft setup 0.050, row 0.040, context 0.080/1k forwards (fitted, 320 samples)"
    ]
    log.maybe_log(stats)  # no step since: no line
    assert len(lines) == 1


def test_a_stopping_publisher_leaves_what_it_counted_since_the_last_scrape(tmp_path, monkeypatch):
    """A proposer that goes away between two scrapes: its last counts, not only those of the
    last scrape, reach the counters (its final snapshot, read once by each collector); one that
    lived and stopped between two scrapes counts too. A second API server's collector, which
    last scraped before the proposer went away, counts the same (the first server's read left
    the final for it)."""
    registry, other = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    registry.register(metrics.StatsCollector(str(tmp_path)))
    other.register(metrics.StatsCollector(str(tmp_path)))

    def scrape(server=registry) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = prometheus_client.generate_latest(server).decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    monkeypatch.setenv(metrics.STATS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(metrics, "PUBLISH_INTERVAL_S", 0.01)

    class Owner:
        pass

    owner, stats = Owner(), metrics.StepStats()
    publisher = metrics.StatsPublisher(owner, stats)
    stats.record_step(draft_tokens=6, accepted=4, seconds=0.0003, skipped={"request": 0, "load": 0})
    deadline = metrics.time.monotonic() + 10
    while scrape().get("lookahead_draft_tokens_total") != 6 and metrics.time.monotonic() < deadline:
        metrics.time.sleep(0.01)
    assert scrape()["lookahead_draft_tokens_total"] == 6 and scrape(other)["lookahead_draft_tokens_total"] == 6
    stats.record_step(draft_tokens=3, accepted=1, seconds=0.0003, skipped={"request": 0, "load": 0})
    del owner  # the proposer goes away before the collectors read the 3 more
    import gc

    gc.collect()
    assert os.path.exists(publisher.path + metrics.FINAL_SUFFIX)
    while os.path.exists(publisher.path) and metrics.time.monotonic() < deadline:  # the thread's last removal
        metrics.time.sleep(0.01)
    got = scrape()
    assert got["lookahead_draft_tokens_total"] == 9 and got["lookahead_steps_total"] == 2
    assert scrape()["lookahead_draft_tokens_total"] == 9  # read once
    theirs = scrape(other)  # the other server: the final was left for it
    assert theirs["lookahead_draft_tokens_total"] == 9 and theirs["lookahead_steps_total"] == 2
    assert scrape(other)["lookahead_draft_tokens_total"] == 9
    brief, brief_stats = Owner(), metrics.StepStats()  # lives and stops between two scrapes
    metrics.StatsPublisher(brief, brief_stats)
    brief_stats.record_step(draft_tokens=2, accepted=2, seconds=0.0003, skipped={"request": 0, "load": 0})
    del brief
    gc.collect()
    assert scrape()["lookahead_draft_tokens_total"] == 11 and scrape(other)["lookahead_draft_tokens_total"] == 11


def test_a_final_snapshot_after_its_file_was_seen_gone_adds_what_it_counted_since(tmp_path):
    """The publisher's file gone before its final snapshot came (a scrape in between counted its
    last-seen snapshot): the final adds only what it counted since; a final older than the
    collector (an earlier server's) is not counted, and removed."""
    stale = tmp_path / "999999999-9.json.final"
    metrics.write_snapshot(str(stale), {"steps": 50, "draft_tokens": 50, "publisher": "old"})
    os.utime(stale, (1.0, 1.0))
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.StatsCollector(str(tmp_path)))

    def scrape() -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = prometheus_client.generate_latest(registry).decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    stats = metrics.StepStats()
    stats.record_step(draft_tokens=6, accepted=4, seconds=0.0003, skipped={"request": 0, "load": 0})
    path = tmp_path / f"{os.getpid()}-0.json"
    metrics.write_snapshot(str(path), {**stats.snapshot(), "publisher": "p"})
    assert scrape()["lookahead_draft_tokens_total"] == 6 and not stale.exists()
    stats.record_step(draft_tokens=3, accepted=1, seconds=0.0003, skipped={"request": 0, "load": 0})
    path.unlink()
    assert scrape()["lookahead_draft_tokens_total"] == 6  # gone: its last-seen snapshot counts
    metrics.write_snapshot(str(path) + metrics.FINAL_SUFFIX, {**stats.snapshot(), "publisher": "p"})
    got = scrape()
    assert got["lookahead_draft_tokens_total"] == 9 and got["lookahead_steps_total"] == 2
    assert got["lookahead_drafter_seconds_count"] == 2
    assert scrape()["lookahead_draft_tokens_total"] == 9


def test_several_api_servers_serve_the_series_through_multiprocess_registries(tmp_path, monkeypatch):
    """With several API servers (prometheus multiprocess mode) ``/metrics`` is served from a
    registry built for each scrape around a ``MultiProcessCollector`` (vLLM's
    ``get_prometheus_registry``; its instrumentator's handler builds one per request): the
    plugin's patch adds the lookahead collector to every such registry."""
    from prometheus_client import multiprocess

    from lookahead_vllm.vllm.plugin import register

    register()  # the plugin in this process: its patches and its collector
    from vllm.v1.metrics import prometheus

    stats = metrics.StepStats()
    stats.record_step(draft_tokens=5, accepted=3, seconds=0.001, skipped={"request": 0, "load": 0})
    monkeypatch.setattr(metrics._collector, "directory", str(tmp_path))
    monkeypatch.setattr(metrics._collector, "_last", {})
    monkeypatch.setattr(metrics._collector, "_gone", {})
    metrics.write_snapshot(str(tmp_path / f"{os.getpid()}-0.json"), stats.snapshot())
    (tmp_path / "prom").mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    ephemeral = prometheus_client.CollectorRegistry()  # as the instrumentator's /metrics handler does
    multiprocess.MultiProcessCollector(ephemeral)
    for registry in (prometheus.get_prometheus_registry(), ephemeral):
        assert registry is not prometheus_client.REGISTRY
        text = prometheus_client.generate_latest(registry).decode()
        assert "lookahead_draft_tokens_total 5.0" in text and "lookahead_accepted_tokens_total 3.0" in text
