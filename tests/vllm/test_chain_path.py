"""The proposer with index chains (the default): native against its reference.

Two proposers with the same settings, one with the native extension and one
on the references of the index, trie and planner kernels
(lookahead_lab.reference), are driven the way the model runner drives them through a
simulated workload:
requests over real text (tests/data/real_text.md) whose outputs accept the drafts that
match the text; admissions and finishes mid-run, per-request caps and
opt-outs, the scheduler cutting drafts, a preemption that rewinds a request,
requests that hit ``max_model_len``, load adaptation. Every step's drafts,
the calibrator's state and the counters must be equal.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.settings import lookahead

pytestmark = pytest.mark.vllm

# Real text that stays put (a past README of this project), unlike the README itself.
TEXT = Path(__file__).resolve().parents[1] / "data" / "real_text.md"
MAX_LEN = 320


class Workload:
    """Running requests over real text: each commits the tokens of its text
    that its draft got right, then one more (the bonus)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.text = np.frombuffer(TEXT.read_bytes(), np.uint8).astype(np.int64)
        self.running: dict[str, list] = {}  # id -> [text start, prompt len, committed len, extra_args]
        self.next_id = 0
        self.drafts: dict[str, list[int]] = {}

    def admit(self) -> list[SimpleNamespace]:
        new = []
        most = int(self.rng.integers(4, 15))  # the batch grows and shrinks
        while len(self.running) < most and self.rng.random() < 0.7:
            rid = f"r{self.next_id}"
            self.next_id += 1
            plen = int(self.rng.integers(8, 200))
            # A few near max_model_len, some with a cap or drafting off.
            if self.rng.random() < 0.1:
                plen = MAX_LEN - int(self.rng.integers(2, 6))
            # A quarter of the requests start at a line seen before (repeats).
            start = int(self.rng.integers(0, len(self.text) - MAX_LEN))
            args = [None, {"lookahead_max_draft_tokens": 3}, {"lookahead_enabled": False}][
                int(self.rng.choice(3, p=[0.8, 0.1, 0.1]))]
            self.running[rid] = [start, plen, plen + 1, args]
            new.append(SimpleNamespace(req_id=rid, sampling_params=SimpleNamespace(extra_args=args)))
        return new

    def accepted(self, req_id: str, draft: list[int], truth: list[int]) -> int:
        """Draft tokens verification accepts: the prefix that matches the text."""
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[accepted]:
            accepted += 1
        return accepted

    def step_inputs(self):
        finished = [r for r, (_, plen, n, _) in self.running.items()
                    if n >= MAX_LEN or n - plen > 150 or self.rng.random() < 0.02]
        for r in finished:
            del self.running[r]
            self.drafts.pop(r, None)
        new = self.admit()
        ids = list(self.running)
        self.rng.shuffle(ids)  # the persistent batch reorders rows
        scheduled, sampled = {}, []
        for r in ids:
            start, plen, n, _ = self.running[r]
            draft = self.drafts.get(r, [])
            if draft and self.rng.random() < 0.2:  # the scheduler cut the draft
                draft = draft[:int(self.rng.integers(0, len(draft)))]
            if draft:
                scheduled[r] = draft
            truth = self.text[start + n: start + n + len(draft) + 1].tolist()
            accepted = self.accepted(r, draft, truth)
            emitted = truth[:accepted + 1]
            n = min(n + len(emitted), MAX_LEN)
            if self.rng.random() < 0.01:  # preempted and recomputed: the runner rewinds
                n, emitted = plen + 1, [int(self.text[start + plen])]
                scheduled.pop(r, None)  # a recomputed request verifies no draft
            self.running[r][2] = n
            sampled.append(emitted if self.rng.random() > 0.03 else [])  # a row that sampled nothing
        table = np.zeros((len(ids) + 2, MAX_LEN), np.int32)
        for i, r in enumerate(ids):
            start, _, n, _ = self.running[r]
            table[i, :n] = self.text[start:start + n]
        num_tokens = np.zeros(len(ids) + 2, np.int64)
        num_tokens[:len(ids)] = [self.running[r][2] for r in ids]
        batch = SimpleNamespace(req_ids=ids, num_prompt_tokens=np.array([self.running[r][1] for r in ids] + [0, 0]))
        return batch, finished, new, scheduled, sampled, num_tokens, table


def drive_pair(a, b, work: Workload, steps: int, tables=("predicted", "accepted", "nodes")) -> int:
    """Steps both proposers through ``work`` as the runner does, asserting
    equal drafts and calibrator ``tables`` after every step; returns the
    draft tokens handed out."""
    handed = 0
    for _ in range(steps):
        batch, finished, new, scheduled, sampled, num_tokens, table = work.step_inputs()
        outs = []
        for p in (a, b):
            p.on_step(batch, finished, scheduled)
            p.on_new_requests(new)
            outs.append(p.propose(sampled, num_tokens, table))
        assert outs[0] == outs[1]
        work.drafts = dict(zip(batch.req_ids, outs[0]))
        handed += sum(map(len, outs[0]))
        for name in tables:
            np.testing.assert_array_equal(getattr(a.calibrator, name), getattr(b.calibrator, name))
    return handed


@pytest.mark.parametrize("seed,settings", [
    (0, {}),
    (1, {"load_shrink_above": 4, "load_stop_at": 12}),  # load adaptation shrinks budgets
    (2, {"step_draft_budget": 24, "cost_free_tokens": 16, "cost_marginal_tokens": 8.0}),
    (3, {"cost_free_tokens": 0, "min_draft_confidence": 0.0}),  # every drafted token kept
])
def test_chains_native_equal_reference(seed, settings):
    """A proposer on the references drafts what the native one drafts: the
    same drafts, calibrator tables and counters."""
    from lookahead_lab import reference
    from lookahead_lab.reference import on_reference
    from lookahead_lab.standalone import standalone_proposer

    fast = standalone_proposer(16, MAX_LEN, lookahead(**settings))
    ref = on_reference(lambda: standalone_proposer(16, MAX_LEN, lookahead(**settings)))
    before = dict(reference.calls)
    assert fast.drafter.index.native and not ref.drafter.index.native and not fast.tree_mode
    handed = drive_pair(fast, ref, Workload(seed), 200, ("predicted", "accepted", "nodes", "_factor"))
    for kernel in ("plan_trees", "match_trees", "observe_trees"):  # the reference side ran the reference planner
        assert reference.calls[kernel] > before.get(kernel, 0), kernel
    counters = fast.stats.counters(), ref.stats.counters()
    assert {k: v for k, v in counters[0].items() if k != "propose_ns"} == {
        k: v for k, v in counters[1].items() if k != "propose_ns"}
    assert fast.metrics.skipped_request_steps == ref.metrics.skipped_request_steps
    # The workload exercised what it claims: drafts handed out and accepted,
    # calibration evidence, rewinds, and the states follow the requests.
    c = counters[0]
    assert handed > 150 and c["context_accepted_tokens"] > 50 and c["tree_request_steps"] == 0
    assert fast.calibrator.nodes.sum() > 100 and c["rewinds"] > 0
    assert set(fast.request_ids()) == set(ref.request_ids())
    if settings.get("load_stop_at"):
        assert fast.metrics.skipped_request_steps["load"] > 0
    assert fast.metrics.skipped_request_steps["request"] > 0


def test_upkeep_on_its_thread_equals_inline():
    """The native index's upkeep on its own thread (the GPU default) drafts
    what it drafts inline, with finished outputs evicted over a small corpus
    cap along the way."""
    from lookahead_lab.standalone import standalone_proposer

    settings = {"index_corpus_bytes": 48_000}  # 24,000 bytes for each of the index and its back-off
    threaded = standalone_proposer(16, MAX_LEN, lookahead(**settings, upkeep_thread=True))
    inline = standalone_proposer(16, MAX_LEN, lookahead(**settings, upkeep_thread=False))
    assert threaded.drafter.index.native and threaded.drafter.index.config.corpus_bytes == 24_000
    work = Workload(5)
    handed = drive_pair(threaded, inline, work, 150)
    assert threaded.stats.counters()["draft_tokens"] == inline.stats.counters()["draft_tokens"]
    index = threaded.drafter.index
    # The cap binds finished outputs: over it, eviction has taken them all
    # (running requests' texts are never evicted).
    finished = index.num_sequences() - index.num_live()
    assert handed > 100 and index.corpus_bytes() > 0
    assert index.corpus_bytes() <= 24_000 or finished == 0, (index.corpus_bytes(), finished)
    assert index.num_sequences() < work.next_id  # finished outputs were evicted
