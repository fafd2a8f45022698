"""LookaheadProposer against a fake persistent batch: rows, skips, lifecycle, budgets."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lookahead_lab.reference.trees import step_plan
from tests.settings import lookahead

pytestmark = pytest.mark.vllm

MAX_LEN = 64
A = [1, 2, 3, 4, 5] * 3  # "a" repeats 1..5
B = [7, 8, 9] * 4  # "b" repeats 7..9


def make_proposer(k: int = 4, **fields):
    """A proposer of ``fields`` (public fields and profile knobs, tests/settings.py)."""
    from lookahead_lab.standalone import standalone_proposer

    # Row bookkeeping tests want every draft token: the forward-cost model is
    # off unless a test prices tokens itself.
    fields.setdefault("cost_free_tokens", 0)
    return standalone_proposer(k, MAX_LEN, lookahead(**fields))


def on_platform(monkeypatch, platform: str) -> None:
    """Resolve the next proposers' settings for ``platform`` ("cpu" or "gpu")."""
    from lookahead_vllm.vllm import config as la_config

    monkeypatch.setattr(la_config, "current_platform_name", lambda: platform)


def step(proposer, rows: dict[str, list[int]], prompt_lens: dict[str, int], finished=(), sampled=None,
         scheduled=None):
    """Run one propose() over ``rows`` (req id -> all committed tokens), in dict order;
    ``scheduled``: the draft tokens vLLM scheduled per request this step."""
    ids = list(rows)
    batch = SimpleNamespace(req_ids=ids, num_prompt_tokens=np.array([prompt_lens[r] for r in ids]))
    proposer.on_step(batch, finished, scheduled)
    tokens = np.zeros((len(ids), MAX_LEN), dtype=np.int64)
    for i, r in enumerate(ids):
        tokens[i, :len(rows[r])] = rows[r]
    num_tokens = np.array([len(rows[r]) for r in ids])
    sampled = sampled or [[rows[r][-1]] for r in ids]
    return proposer.propose(sampled, num_tokens, tokens)


def test_drafts_follow_each_rows_own_request():
    p = make_proposer()
    drafts = step(p, {"b": B + [7], "a": A + [1]}, {"a": len(A), "b": len(B)})
    assert drafts == [[8, 9, 7, 8], [2, 3, 4, 5]]
    drafts = step(p, {"a": A + [1, 2], "b": B + [7, 8]}, {"a": len(A), "b": len(B)})  # rows swapped
    assert drafts == [[3, 4, 5, 1], [9, 7, 8, 9]]


def test_rows_without_sample_or_at_max_len_get_no_draft():
    p = make_proposer()
    full = (A * 5)[:MAX_LEN]
    drafts = step(p, {"a": A + [1], "b": full}, {"a": len(A), "b": 8}, sampled=[[], [full[-1]]])
    assert drafts == [[], []]
    assert p.drafter.num_requests() == 0  # neither row was admitted


def test_finish_eliminates_and_same_id_can_return():
    p = make_proposer()
    step(p, {"a": A + [1]}, {"a": len(A)})
    assert p.num_request_states() == 1 and p.drafter.num_requests() == 1
    step(p, {"b": B + [7]}, {"b": len(B)}, finished=["a"])
    assert p.num_request_states() == 1 and p.drafter.num_requests() == 1
    drafts = step(p, {"a": B + [7]}, {"a": len(B)})  # a new request reusing the id
    assert drafts == [[8, 9, 7, 8]]


def test_reset_forgets_requests_and_counts():
    p = make_proposer()
    step(p, {"a": A + [1]}, {"a": len(A)})
    step(p, {"a": A + [1, 2, 9]}, {"a": len(A)}, sampled=[[2, 9]], scheduled={"a": [2, 3]})
    assert p.calibrator.nodes.sum() == 2
    p.reset()
    assert p.drafter.num_requests() == 0
    assert p.calibrator.nodes.sum() == 0
    assert step(p, {"a": A + [1, 2]}, {"a": len(A)}) == [[3, 4, 5, 1]]  # re-admitted from scratch


@pytest.mark.parametrize("platform,upkeep,thread", [("cpu", {}, False), ("gpu", {}, True),
                                                    ("gpu", {"upkeep_thread": False}, False),
                                                    ("cpu", {"upkeep_thread": True}, True)])
def test_index_upkeep_thread_follows_the_platform(monkeypatch, platform, upkeep, thread):
    """The profile's upkeep_thread: the native indexes' upkeep on threads on
    GPUs, inline on the CPU; after a reset too. The drafts are the same."""
    on_platform(monkeypatch, platform)
    p = make_proposer(**upkeep)
    assert p.drafter.index.upkeep_thread is thread and p.drafter.backoff.upkeep_thread is thread
    assert step(p, {"a": A + [1, 2]}, {"a": len(A)}) == [[3, 4, 5, 1]]
    p.reset()
    assert p.drafter.index.upkeep_thread is thread


@pytest.mark.parametrize("platform, rows, budget", [("cpu", 16, 4), ("cpu", 40, 2), ("cpu", 64, 0), ("gpu", 16, 4),
                                                   ("gpu", 64, 3)])
def test_load_adaptation_follows_the_platform(monkeypatch, platform, rows, budget):
    """With the default load limits the budget (k=4) is whole up to 16 running requests on the CPU and shrinks to
    nothing at 64 (16 to 64); on a GPU it is whole up to 32 and shrinks to nothing at 128."""
    on_platform(monkeypatch, platform)
    p = make_proposer(k=4)
    batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(rows)])
    load_budget = p._budgets(np.full(rows, 100), [None] * rows, batch)[2]
    assert load_budget == budget


def test_rewound_request_is_readmitted():
    p = make_proposer()
    step(p, {"a": A + [1, 2, 3]}, {"a": len(A)})
    drafts = step(p, {"a": A + [1]}, {"a": len(A)})  # runner dropped two tokens
    assert drafts == [[2, 3, 4, 5]]
    assert p.drafter.num_requests() == 1


@pytest.mark.parametrize("source", ["index", "index+trie", "trie"])
def test_tokens_sampled_in_place_of_dropped_ones_are_drafted_from(source):
    """vLLM's runner drops a request's last sampled tokens when their KV failed to load, and samples again in their
    place, as many tokens or fewer: the next drafts follow the new tokens, as a fresh proposer's do."""
    def fresh(rows):
        return step(make_proposer(source=source), rows, {"a": len(A)})

    for before, after in (([1], [4]), ([1, 2], [1])):  # the same count (the last token replaced), one fewer
        p = make_proposer(source=source)
        step(p, {"a": A + before}, {"a": len(A)})
        assert step(p, {"a": A + after}, {"a": len(A)}) == fresh({"a": A + after}) != [[]]


def test_step_budget_and_stats():
    p = make_proposer(step_draft_budget=5, min_draft_confidence=0.0)
    drafts = step(p, {"a": A + [1], "b": B + [7]}, {"a": len(A), "b": len(B)})
    assert sum(map(len, drafts)) == 5
    stats = p.stats.counters()
    assert stats["max_step_draft_tokens"] == 5 and stats["request_steps"] == 2


def test_decoding_length_above_k_rejected():
    with pytest.raises(ValueError, match="decoding_length=8: must be <= speculative_config.num_speculative_tokens=4"):
        make_proposer(k=4, decoding_length=8)


def test_per_request_cap_and_off():
    p = make_proposer()
    p.on_new_requests([
        SimpleNamespace(req_id="a", sampling_params=SimpleNamespace(extra_args={"lookahead_enabled": False})),
        SimpleNamespace(req_id="b", sampling_params=SimpleNamespace(extra_args={"lookahead_max_draft_tokens": 2})),
    ])
    drafts = step(p, {"a": A + [1], "b": B + [7]}, {"a": len(A), "b": len(B)})
    assert drafts == [[], [8, 9]]
    assert p.drafter.num_requests() == 2  # an opted-out request still feeds the index
    assert p.metrics.skipped_request_steps == {"request": 1, "load": 0, "cost": 0}
    step(p, {"c": B + [7]}, {"c": len(B)}, finished=["a", "b"])
    assert p.num_request_states() == 1  # states (and their caps) go with their requests


@pytest.mark.parametrize("extra_args", [{"lookahead_max_draft_tokens": "4", "lookahead_enabled": False},
                                        ["not", "a", "mapping"]])
def test_options_that_fail_in_the_worker_stop_drafting_not_the_engine(caplog, extra_args):
    """extra_args are validated when the request is made; ones changed after that (offline
    use) are logged by the worker and the request drafts nothing (it may have asked for that),
    instead of raising inside the engine step."""
    import logging

    p = make_proposer()
    with caplog.at_level(logging.WARNING):
        p.on_new_requests([SimpleNamespace(req_id="a", sampling_params=SimpleNamespace(extra_args=extra_args))])
    assert any("request a" in r.getMessage() and "drafts nothing" in r.getMessage() for r in caplog.records)
    assert step(p, {"a": A + [1], "b": A + [1]}, {"a": len(A), "b": len(A)}) == [[], [2, 3, 4, 5]]
    assert p.request_state("a").cap == 0


@pytest.mark.parametrize("request_fields", [{"prompt_embeds": object()},
                                            {"prompt_is_token_ids": [True, False, True]}])
def test_a_prompt_given_as_embeddings_drafts_nothing(request_fields):
    """vLLM leaves an embedded prompt's positions of the token table unwritten (they hold an
    earlier request's tokens): such a request drafts nothing, in no partition."""
    from lookahead_vllm.core.draft_index import PRIVATE

    p = make_proposer()
    p.on_new_requests([SimpleNamespace(req_id="e", sampling_params=None, cache_salt="t", **request_fields),
                       SimpleNamespace(req_id="b", sampling_params=None, prompt_is_token_ids=[True] * 3)])
    assert step(p, {"e": A + [1], "b": A + [1]}, {"e": len(A), "b": len(A)}) == [[], [2, 3, 4, 5]]
    assert (p.request_state("e").cap, p.request_state("e").partition) == (0, PRIVATE)


def test_a_salted_request_not_yet_synced_keeps_its_partition_through_a_sweep(monkeypatch):
    """The runner admits a request a step (or a chunked prefill) before its first draft: the
    native index does not know it yet, so the proposer's own states must keep its partition
    through a sweep, or a new salt would take its id (and later draft from its outputs)."""
    from lookahead_vllm.core import partitions

    monkeypatch.setattr(partitions, "SWEEP_FIRST", 2)
    p = make_proposer()
    p.on_new_requests([SimpleNamespace(req_id="x", sampling_params=None, cache_salt="kept")])  # a sweep is due
    p.on_new_requests([SimpleNamespace(req_id="y", sampling_params=None, cache_salt="other")])
    x, y = p.request_state("x").partition, p.request_state("y").partition
    assert x != y and p.drafter.partition("kept") == x


def test_a_reset_keeps_the_running_requests_partitions():
    """``reset`` (a cold start with requests still running) forgets what was learned, not
    which salt owns which partition: a new salt never takes a running request's id."""
    p = make_proposer()
    p.on_new_requests([SimpleNamespace(req_id="a", sampling_params=None, cache_salt="tenant-a")])
    a = p.request_state("a").partition
    p.reset()
    p.on_new_requests([SimpleNamespace(req_id="b", sampling_params=None, cache_salt="tenant-b")])
    assert p.request_state("b").partition != a and p.drafter.partition("tenant-a") == a
    idle = make_proposer()  # none running (a start that ends cold): numbered afresh, as on every rank
    idle.drafter.partition("learned-from-a-snapshot")
    idle.reset()
    assert idle.drafter.partition("tenant-b") == make_proposer().drafter.partition("tenant-b")


@pytest.mark.parametrize("rank, logs", [(0, True), (1, False)])
def test_only_the_first_tensor_parallel_rank_logs_the_interval_line(monkeypatch, rank, logs):
    """Every tensor-parallel rank drafts the same tokens: one periodic line per engine, not one
    per rank."""
    import math

    from lookahead_vllm.vllm import metrics

    monkeypatch.setattr(metrics, "tp_rank", lambda: rank)
    p = make_proposer()
    assert math.isfinite(p._interval_log.interval_s) == logs


def test_a_steps_request_facts_follow_the_batch_and_its_options():
    """A step reuses its rows' states, slots, partitions and caps while the batch holds the same
    requests and none changed: an option that arrives for a request already running (its state
    made by a step before the runner's new-request hook), a finished request whose row a new one
    takes and a reordered batch all show in the next step's drafts."""
    p = make_proposer()
    rows, lens = {"a": A + [1], "b": B + [7]}, {"a": len(A), "b": len(B)}
    assert step(p, rows, lens) == [[2, 3, 4, 5], [8, 9, 7, 8]]
    assert step(p, rows, lens) == [[2, 3, 4, 5], [8, 9, 7, 8]]  # the same batch again: the same facts
    p.on_new_requests([SimpleNamespace(req_id="a", sampling_params=SimpleNamespace(
        extra_args={"lookahead_max_draft_tokens": 1}))])
    assert step(p, rows, lens) == [[2], [8, 9, 7, 8]]  # a's cap, though its id and row did not change
    assert step(p, {"b": B + [7], "a": A + [1]}, lens) == [[8, 9, 7, 8], [2]]  # reordered
    c = step(p, {"c": B + [7], "b": B + [7]}, {"c": len(B), "b": len(B)}, finished=["a"])
    assert c == [[8, 9, 7, 8], [8, 9, 7, 8]]
    assert p.request_state("c").cap is None and p.request_state("a") is None


def test_a_request_finished_and_back_under_its_id_in_one_step_gets_a_new_state():
    """The batch's request ids are the same as last step's, but the request under one of them
    finished and a new one took its id (made without the runner's new-request hook): the step
    must not reuse the kept facts of the finished request."""
    p = make_proposer()
    step(p, {"a": A + [1]}, {"a": len(A)})
    old = p.request_state("a")
    assert step(p, {"a": B + [7]}, {"a": len(B)}, finished=["a"]) == [[8, 9, 7, 8]]
    new = p.request_state("a")
    assert new is not None and new is not old and new.slot != old.slot
    assert p.num_request_states() == 1 and p.drafter.num_requests() == 1


def test_load_adaptation_shrinks_then_stops_drafting():
    rows = {f"r{i}": B + [7] for i in range(4)}
    lens = {r: len(B) for r in rows}
    # The forward-cost model is off here (cost_free_tokens=0): only load adapts.
    full = make_proposer(k=4, min_draft_confidence=0.0, load_shrink_above=4, load_stop_at=6, cost_free_tokens=0)
    assert all(len(d) == 4 for d in step(full, rows, lens))
    rows5 = {**rows, "r4": B + [7]}
    half = make_proposer(k=4, min_draft_confidence=0.0, load_shrink_above=4, load_stop_at=6, cost_free_tokens=0)
    assert [len(d) for d in step(half, rows5, {**lens, "r4": len(B)})] == [2] * 5  # ceil(4 * 1/2)
    rows6 = {**rows5, "r5": B + [7]}
    stop = make_proposer(k=4, load_shrink_above=4, load_stop_at=6)
    assert step(stop, rows6, {r: len(B) for r in rows6}) == [[]] * 6
    assert stop.metrics.skipped_request_steps["load"] == 6 and stop.metrics.load_budget == 0
    assert stop.drafter.num_requests() == 6  # tokens still indexed while not drafting


def test_no_drafting_where_the_cost_model_says_no_draft_pays():
    # 4 tokens per forward for free, each 4 more cost one more forward, rows
    # no more than their tokens: from 4 rows on, no draft token can raise the
    # step's throughput.
    lens = {f"r{i}": len(B) for i in range(4)}
    priced = dict(k=4, min_draft_confidence=0.0, cost_free_tokens=4, cost_marginal_tokens=4.0, row_price=0.0)
    p = make_proposer(**priced)
    assert step(p, {r: B + [7] for r in lens}, lens) == [[]] * 4
    assert p.metrics.skipped_request_steps == {"request": 0, "load": 0, "cost": 4}
    assert p.drafter.num_requests() == 4  # still indexed
    three = make_proposer(**priced)  # 3 rows: one token still rides free
    assert sum(map(len, step(three, {r: B + [7] for r in list(lens)[:3]}, lens))) > 0
    assert three.metrics.skipped_request_steps["cost"] == 0
    # Rows that cost on their own (0.1 forwards each past the first) make the
    # 4-row step dear enough that a draft token pays again.
    rowed = make_proposer(**{**priced, "row_price": 0.1})
    assert sum(map(len, step(rowed, {r: B + [7] for r in lens}, lens))) > 0
    assert rowed.metrics.skipped_request_steps["cost"] == 0


def test_forward_cost_model_trims_batch_drafts():
    rows = {f"r{i}": B + [7] for i in range(4)}
    lens = {r: len(B) for r in rows}
    free = make_proposer(k=4, min_draft_confidence=0.0, cost_free_tokens=0)
    assert [len(d) for d in step(free, rows, lens)] == [4] * 4
    # 4 rows fill the free region; past it a token costs half a forward (two
    # tokens' worth at this step's rate), which no draft token can pay for.
    costly = make_proposer(k=4, min_draft_confidence=0.0, cost_free_tokens=4, cost_marginal_tokens=2)
    assert step(costly, rows, lens) == [[]] * 4
    # With room for 8 free tokens, the 4 most confident positions are kept.
    roomy = make_proposer(k=4, min_draft_confidence=0.0, cost_free_tokens=8, cost_marginal_tokens=2)
    assert sum(len(d) for d in step(roomy, rows, lens)) == 4


def window_outputs(p, req_id: str, window_tokens: list[int], nodes: list[int]) -> None:
    """What tree verification hands back for a request whose plan carried its Jacobi window
    (``TreeResults``): the window's new tokens and the accepted nodes."""
    from lookahead_lab.reference.trees import tree_results

    p.on_tree_results(tree_results([(req_id, len(nodes), nodes, window_tokens)]))


def test_jacobi_window_rides_along_and_pool_branches_get_verified():
    from vllm import SamplingParams

    # Cost model off: the window always pays (its pricing is tested below). Context chain off:
    # the trie's chain is what this test follows.
    p = make_proposer(k=16, source="both", jacobi_window=3, jacobi_ngram=3, jacobi_guesses=2,
                      min_draft_confidence=0.0, max_match_length=4, cost_free_tokens=0,
                      context_match=0)
    assert p.config.decoding_length == 16 - 5 and p.tree_mode
    p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
    drafts = step(p, {"a": A + [1]}, {"a": len(A)})
    plan = step_plan(p.handed_out, "a")
    # The trie's chain (depth <= branch_length - 4), then W(N-1)-1 = 5 window nodes.
    n = plan.lookahead.count(False)
    assert n == 8 and drafts[0][:n] == [2, 3, 4, 5, 1, 2, 3, 4] and len(drafts[0]) == n + 5
    assert plan.lookahead == (False,) * n + (True,) * 5
    window_tokens = drafts[0][n:]
    assert set(window_tokens) <= set(A)  # initialised from the prompt
    # The step's new tokens (one per column): three n-grams keyed 1 (x0), then level 0.
    window_outputs(p, "a", [40, 41, 42], nodes=[0, 1])
    jacobi, slot = p.drafter.jacobi, p.request_state("a").slot
    assert p.stats.pool_ngrams_added == 3 and len(jacobi.pool(slot, 1)) == 1
    cont = jacobi.pool(slot, 1)[0]
    assert cont == (window_tokens[2], 40)  # column 0: x0, level 1's first node, the new token
    assert cont[0] != 2  # (this prompt's window: the branch does not share the trie chain's first node)
    # Next time x0 is 1 the pool branch is merged into the verify tree.
    drafts = step(p, {"a": A + [1, 2, 3, 4, 5, 1]}, {"a": len(A)})
    verify = [t for t, look in zip(drafts[0], step_plan(p.handed_out, "a").lookahead) if not look]
    assert p.stats.pool_branches == 1 and verify[-1] == 40 and verify[0] == 2
    # The target follows the pool branch from the root: two pool tokens,
    # booked on any verified step (with or without the window).
    assert verify[-2:] == list(cont)
    before = p.stats.pool_accepted_tokens
    step(p, {"a": A + [1, 2, 3, 4, 5, 1, *cont, 99]}, {"a": len(A)}, sampled=[[*cont, 99]],
         scheduled={"a": drafts[0]})
    assert p.stats.pool_accepted_tokens == before + 2
    # A finished request drops its window and pool.
    step(p, {"b": B + [7]}, {"b": len(B)}, finished=["a"])
    assert p.request_state("a") is None and jacobi.policy(slot) is None and jacobi.num_slots == 0


def test_with_the_cost_model_off_every_window_goes():
    """cost_free_tokens 0 hands out every draft, Jacobi windows included: a window whose
    yield estimate is far below what the draft setup and its row's context price would
    ask of it still rides along on a row that drafted nothing else."""
    from vllm import SamplingParams

    from lookahead_vllm.core.jacobi import PROBE_EVERY

    p = make_proposer(k=16, source="jacobi", jacobi_window=3, jacobi_ngram=3, jacobi_guesses=2,
                      context_price=2.0)
    p.drafter.jacobi.prior = (0.001, PROBE_EVERY)  # what earlier requests saw: the window brought nothing
    p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
    prompt = list(range(100, 140))  # no repeats: nothing to draft but the window
    drafts = step(p, {"a": prompt}, {"a": len(prompt)})
    assert step_plan(p.handed_out, "a").lookahead == (True,) * 5 and len(drafts[0]) == 5
    assert p.stats.jacobi_steps == 1


@pytest.mark.parametrize("cap, sent", [(None, 16), (16, 16), (15, 11), (4, 4)])
def test_a_window_stays_within_its_requests_cap(cap, sent):
    """A request's own cap (``lookahead_max_draft_tokens``) bounds every draft node of its
    step, a Jacobi window's too: an 11-node draft (its own repeats) takes the 5-node window
    only where the cap holds both (a cap below decoding_length never opens a window)."""
    from vllm import SamplingParams

    p = make_proposer(k=16, source="both", jacobi_window=3, jacobi_ngram=3, jacobi_guesses=2,
                      min_draft_confidence=0.0)
    extra = {} if cap is None else {"lookahead_max_draft_tokens": cap}
    p.on_new_requests([SimpleNamespace(req_id="a", sampling_params=SimpleNamespace(extra_args=extra))])
    p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
    prompt = (A * 10)[:40]
    drafts = step(p, {"a": prompt}, {"a": len(prompt)})
    assert p.config.decoding_length == 11 and len(drafts[0]) == sent
    assert p.stats.jacobi_steps == (sent > 11)


@pytest.mark.parametrize("max_tokens, sent", [(None, 16), (40, 16), (12, 10), (3, 1), (2, 0)])
def test_drafts_stop_at_the_requests_max_tokens(max_tokens, sent):
    """A request stops at its max_tokens, and vLLM drops what a step accepts past it: a row one output token into
    a 30-token prompt drafts at most max_tokens - 2 tokens (its draft, then the bonus token, end there)."""
    p = make_proposer(k=16, min_draft_confidence=0.0)
    p.on_new_requests([SimpleNamespace(req_id="a", sampling_params=SimpleNamespace(extra_args={},
                                                                                   max_tokens=max_tokens))])
    tokens = (A * 10)[:31]  # its own repeats: the index would draft all 16
    drafts = step(p, {"a": tokens}, {"a": 30})
    assert len(drafts[0]) == sent and drafts[0] == ((A * 10)[31:31 + sent])


@pytest.mark.parametrize("left, sent", [(16, 16), (15, 11)])
def test_a_window_goes_only_where_it_fits_before_max_model_len(left, sent):
    """A row ``left`` positions short of max_model_len - 1 keeps an 11-node draft (its own
    repeats) and takes a 5-node window only if both fit: vLLM runs the proposer whatever the
    batch's longest request (drafter_near_max_len), so the proposer bounds every row itself."""
    from vllm import SamplingParams

    p = make_proposer(k=16, source="both", jacobi_window=3, jacobi_ngram=3, jacobi_guesses=2,
                      min_draft_confidence=0.0)
    p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
    prompt = (A * 10)[:MAX_LEN - 1 - left]
    drafts = step(p, {"a": prompt}, {"a": len(prompt)})
    assert p.config.decoding_length == 11 and len(drafts[0]) == sent
    assert p.stats.jacobi_steps == (sent > 11)


def test_jacobi_state_rebuilt_identically_after_a_rewind():
    from vllm import SamplingParams

    p = make_proposer(k=16, source="jacobi", jacobi_window=3, jacobi_ngram=3, jacobi_guesses=2, cost_free_tokens=0)
    p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
    step(p, {"a": A + [1]}, {"a": len(A)})
    jacobi, slot = p.drafter.jacobi, p.request_state("a").slot
    first = jacobi.window_tokens(slot)
    window_outputs(p, "a", [40, 41, 42], nodes=[])
    step(p, {"a": A + [1, 2, 3]}, {"a": len(A)})
    assert jacobi.window_tokens(slot) != first and jacobi.pool_size(slot) == 3
    # vLLM recomputes the request (preemption): the runner rewinds its tokens.
    step(p, {"a": A + [1]}, {"a": len(A)})
    assert jacobi.window_tokens(slot) == first and jacobi.pool_size(slot) == 0


def test_jacobi_window_is_priced_by_the_cost_model():
    from vllm import SamplingParams

    def proposer():
        p = make_proposer(k=16, source="jacobi", jacobi_window=3, jacobi_ngram=3, jacobi_guesses=2,
                          cost_free_tokens=4, cost_marginal_tokens=8)
        p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
        return p

    # Prior yield 1 token vs need 1 * (cost(6 tokens, 3 paths) / cost(1) - 1)
    # = 0.25 + 0.09 + 3 * 0.02 (CPU path rounds: setup, per path) = 0.40: sent.
    from lookahead_vllm.core.config import PLATFORM_VALUES
    p = proposer()
    cpu = PLATFORM_VALUES["cpu"]
    assert (p.cost.path_setup, p.cost.per_path) == (cpu["path_setup"], cpu["cost_per_path"]) == (0.09, 0.02)
    assert p.cost(6, 3) == pytest.approx(1.40)
    step(p, {"a": A + [1]}, {"a": len(A)})
    assert step_plan(p.handed_out, "a").has_lookahead and p.stats.jacobi_steps == 1
    # The pool never pays: the estimate decays below 0.40 and the window stays home.
    for _ in range(8):
        p.drafter.jacobi.credit(p.request_state("a").slot, 0)
    step(p, {"a": A + [1, 2]}, {"a": len(A)})
    assert step_plan(p.handed_out, "a") is None and p.stats.jacobi_steps == 1


def test_jacobi_budget_checked_against_num_speculative_tokens():
    with pytest.raises(ValueError, match=r"jacobi_window=4, jacobi_ngram=3, jacobi_guesses=4: the step needs "
                       r"\(W \+ G\) \* \(N - 1\) - 1 = 15 draft slots, more than "
                       r"speculative_config.num_speculative_tokens=8"):
        make_proposer(k=8, source="jacobi")
    with pytest.raises(ValueError, match=r"decoding_length=12 \+ 7 Jacobi lookahead nodes: must be <= "):
        make_proposer(k=16, source="both", decoding_length=12)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=191: vLLM's rejection sampler verifies at most 128"):
        make_proposer(k=191, source="jacobi", jacobi_window=16, jacobi_ngram=7, jacobi_guesses=16)
    with pytest.raises(ValueError, match=r"source='jac': must be one of \('index', 'trie', 'jacobi', 'both'"):
        make_proposer(k=16, source="jac")


def test_tree_side_branches_priced_per_path():
    from vllm import SamplingParams

    prompt = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9]  # after "1 2": 3 twice, 4 once

    def draft(per_path: float) -> list[int]:
        p = make_proposer(k=4, draft_shape="hier", min_draft_confidence=0.0, max_match_length=2,
                          cost_free_tokens=8, path_setup=0.0, cost_per_path=per_path, source="trie")  # tokens free: only paths priced
        p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
        return step(p, {"a": prompt + [1]}, {"a": len(prompt)})[0]

    # Free paths: the tree keeps the rarer branch "4" beside "3" (a second path).
    assert draft(0.0)[:2] == [2, 3] and 4 in draft(0.0)
    # A path costing a whole forward is not worth its third of a token: a chain.
    assert 4 not in draft(1.0) and draft(1.0)[:2] == [2, 3]


def test_calibration_learns_what_the_scheduler_verified_of_last_steps_draft():
    p = make_proposer(k=4, min_draft_confidence=0.0, source="trie")
    assert step(p, {"a": A + [1]}, {"a": len(A)}) == [[2, 3, 4, 5]]
    cal = p.calibrator
    # The scheduler verified only [2, 3]; both were accepted, 7 is the bonus.
    step(p, {"a": A + [1, 2, 3, 7]}, {"a": len(A)}, sampled=[[2, 3, 7]], scheduled={"a": [2, 3]})
    assert cal.nodes.sum() == 2 and cal.accepted.sum() == 2
    # The draft made after "... 3 7" was not scheduled (the request was
    # preempted and recomputed): it is dropped, nothing learned.
    drafted = step(p, {"a": A + [1, 2, 3, 7, 1]}, {"a": len(A)}, sampled=[[1]], scheduled={})[0]
    assert drafted and cal.nodes.sum() == 2
    # The next one is verified in full and wholly rejected (9 is the bonus).
    step(p, {"a": A + [1, 2, 3, 7, 1, 9]}, {"a": len(A)}, sampled=[[9]], scheduled={"a": drafted})
    assert cal.nodes.sum() == 2 + len(drafted) and cal.accepted.sum() == 2
    # With calibration off the same steps teach nothing: raw confidences.
    off = make_proposer(k=4, min_draft_confidence=0.0, source="trie", calibrate_confidence=False)
    assert step(off, {"a": A + [1]}, {"a": len(A)}) == [[2, 3, 4, 5]]
    step(off, {"a": A + [1, 2, 3, 7]}, {"a": len(A)}, sampled=[[2, 3, 7]], scheduled={"a": [2, 3]})
    assert off.calibrator.nodes.sum() == 0 and (off.calibrator.factor_table() == 1).all()


def test_calibrated_confidences_drop_side_branches_that_never_get_accepted():
    from vllm import SamplingParams

    from lookahead_vllm.core.calibration import KIND_BRANCH, KIND_CHAIN

    prompt = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9]  # after "1 2": 3 twice, 4 once
    # Four tokens free, then 20 per forward: the runner-up "4" (raw confidence
    # 0.22) pays for its twentieth of a forward.
    p = make_proposer(k=4, draft_shape="hier", min_draft_confidence=0.0, max_match_length=2,
                      cost_free_tokens=4, cost_marginal_tokens=20, path_setup=0.0, cost_per_path=0.0, source="trie")
    p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
    rows, lens = {"a": prompt + [1]}, {"a": len(prompt)}
    assert step(p, rows, lens)[0] == [2, 3, 9, 4]
    # Verification then shows side branches of that confidence are never accepted.
    # (A tree of two roots, raw 0.5 and 0.22: the first accepted, the side branch never.)
    raw, kinds = np.array([[0.5, 0.22]]), np.array([[KIND_CHAIN, KIND_BRANCH]], np.int8)
    for _ in range(100):
        p.calibrator.observe_trees(raw, kinds, np.array([[1, 0]], np.uint8), np.array([0]), np.array([2]))
    assert step(p, rows, lens)[0] == [2, 3, 9]


def test_new_requests_start_from_the_window_yield_earlier_requests_saw():
    from vllm import SamplingParams

    p = make_proposer(k=16, source="jacobi", jacobi_window=3, jacobi_ngram=3, jacobi_guesses=2,
                      cost_free_tokens=4, cost_marginal_tokens=8)
    greedy = SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))
    p.verifier.runner_requests = {"a": greedy, "b": greedy}
    step(p, {"a": A + [1]}, {"a": len(A)})
    assert step_plan(p.handed_out, "a").has_lookahead  # the prior yield (1 token) pays for the window (needs 0.40)
    for _ in range(8):
        window_outputs(p, "a", [40, 41, 42], nodes=[])  # the window brings nothing
    jacobi = p.drafter.jacobi
    learned = jacobi.policy(p.request_state("a").slot)["yield_est"]
    assert learned < 0.4
    step(p, {"b": B + [7]}, {"b": len(B)}, finished=["a"])
    assert jacobi.policy(p.request_state("b").slot)["yield_est"] == learned
    assert step_plan(p.handed_out, "b") is None  # no fresh optimism: the new request keeps the window home


def test_context_chain_drafts_a_long_repeat_of_the_requests_own_text():
    # Branch length 4: the trie drafts at most 3 tokens below a match.
    run = list(range(20, 40))  # 20 distinct tokens, generated once, then started again
    rows, lens = {"a": [1, 2, 3] + run + [9] + run[:3]}, {"a": 3}
    p = make_proposer(k=8, branch_length=4, max_match_length=2, min_draft_confidence=0.0, source="trie")
    assert step(p, rows, lens) == [run[3:11]]
    assert p.stats.context_drafts == 1
    off = make_proposer(k=8, branch_length=4, max_match_length=2, min_draft_confidence=0.0, context_match=0,
                        source="trie")
    assert step(off, rows, lens) == [run[3:6]] and off.drafter.trie.num_slot_contexts == 0
    # The target accepts five context tokens (then 99, the bonus): booked as context tokens.
    grown = rows["a"] + run[3:8] + [99]
    step(p, {"a": grown}, lens, sampled=[run[3:8] + [99]], scheduled={"a": run[3:11]})
    assert p.stats.context_accepted_tokens == 5
    from lookahead_vllm.core.calibration import KIND_CONTEXT

    assert p.calibrator.nodes[KIND_CONTEXT].sum() == 8 and p.calibrator.accepted[KIND_CONTEXT].sum() == 5
    assert p.drafter.trie.slot_context_length(p.request_state("a").slot) == len(grown)
    # Finished requests drop their index; reset drops all.
    step(p, {"b": B + [7]}, {"b": len(B)}, finished=["a"])
    assert p.drafter.trie.num_slot_contexts == 1
    p.reset()
    assert p.drafter.trie.num_slot_contexts == 0


def test_context_chain_is_not_used_by_source_jacobi():
    from vllm import SamplingParams

    p = make_proposer(k=16, source="jacobi", jacobi_window=3, jacobi_ngram=3, jacobi_guesses=2)
    p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
    step(p, {"a": A + [1]}, {"a": len(A)})
    assert p.drafter.trie is None and p.stats.context_drafts == 0  # no trie: no context chains


def test_index_tree_offers_the_branches_of_diverging_matches():
    from vllm import SamplingParams

    # "1 2 3" was followed by 4 twice and by 5 once: the index drafts 4 first
    # and keeps 5 as a side branch in tree mode.
    prompt = [1, 2, 3, 4, 8, 1, 2, 3, 4, 8, 1, 2, 3, 5, 8]
    p = make_proposer(k=4, draft_shape="hier", min_draft_confidence=0.0, cost_free_tokens=8, path_setup=0.0, cost_per_path=0.0)
    p.verifier.runner_requests = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))}
    draft = step(p, {"a": prompt + [1, 2, 3]}, {"a": len(prompt)})[0]
    assert draft[:2] == [5, 8] or draft[0] == 4
    assert {4, 5} <= set(draft) and step_plan(p.handed_out, "a").tree.parents.count(-1) == 2


def test_rewind_keeps_the_requests_options():
    """A request sent with lookahead off drafts nothing before and after the
    runner rewinds its tokens (preemption/recompute)."""
    p = make_proposer()
    p.on_new_requests([SimpleNamespace(req_id="a", sampling_params=SimpleNamespace(
        extra_args={"lookahead_enabled": False}))])
    assert step(p, {"a": A + [1, 2, 3]}, {"a": len(A)}) == [[]]
    assert step(p, {"a": A + [1]}, {"a": len(A)}) == [[]]  # rewound by two tokens
    assert step(p, {"a": A + [1, 2]}, {"a": len(A)}) == [[]]
    assert p.request_state("a").cap == 0


def test_memory_gauge_is_refreshed_every_few_steps():
    """The drafter's memory gauge (its estimate visits every held sequence)
    is taken at the start of the first step (before the step's drafting, so
    it never waits for an upkeep) and then every MEMORY_GAUGE_EVERY steps."""
    from lookahead_vllm.vllm.proposer import MEMORY_GAUGE_EVERY

    p = make_proposer()
    first = p.drafter.memory_bytes()
    step(p, {"a": A + [1]}, {"a": len(A)})
    assert p.metrics.drafter_bytes == first > 0
    rows = {"a": A + [1]}
    for i in range(1, MEMORY_GAUGE_EVERY):
        rows[f"r{i}"] = B + [7] * i  # more requests: the drafter grows
        step(p, rows, {r: len(A) if r == "a" else len(B) for r in rows})
        assert p.metrics.drafter_bytes == first  # not refreshed yet
    before = p.drafter.memory_bytes()
    step(p, rows, {r: len(A) if r == "a" else len(B) for r in rows})
    assert p.metrics.drafter_bytes == before > first


# ------------------------------------------------------ prices measured online
def _shape(tokens: int, pure: bool = True, continuing: bool = True, drafted: bool = True, rows: int = 1,
           context: int = 0):
    from lookahead_vllm.vllm.proposer import StepShape

    return StepShape(tokens, pure, continuing, drafted, rows, context)


def test_step_shape_reads_the_scheduler_output():
    from lookahead_vllm.vllm.proposer import StepShape

    def out(new, cached, num_scheduled, spec, computed=(300, 2000, 50)):
        return SimpleNamespace(scheduled_new_reqs=new,
                               scheduled_cached_reqs=SimpleNamespace(req_ids=cached,
                                                                     num_computed_tokens=list(computed[:len(cached)])),
                               num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
                               scheduled_spec_decode_tokens=spec)

    decode = out([], ["a", "b"], {"a": 4, "b": 1}, {"a": [5, 6, 7]})
    assert StepShape.of(decode) == StepShape(5, True, True, True, 2, 300)  # a's context: it carries the drafts
    both = out([], ["a", "b", "c"], {"a": 4, "b": 2, "c": 1}, {"a": [5, 6, 7], "b": [9], "c": []})
    assert StepShape.of(both) == StepShape(7, True, True, True, 3, 2300)
    draftless = out([], ["a", "b"], {"a": 1, "b": 1}, {})
    assert StepShape.of(draftless) == StepShape(2, True, True, False, 2)
    chunk = out([], ["a", "b"], {"a": 4, "b": 64}, {"a": [5, 6, 7]})  # b prefills a chunk
    assert StepShape.of(chunk) == StepShape(68, False, True, True, 2, 300)
    fresh = out([SimpleNamespace(req_id="c")], [], {"c": 12}, {})
    assert StepShape.of(fresh) == StepShape(12, False, False, False, 1)


def test_prices_are_fitted_from_step_times_and_published():
    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_vllm.core.prices import REFIT_EVERY

    p = make_proposer(cost_free_tokens=-1)  # measured online
    assert p.prices is not None and (p.cost.free_tokens, p.cost.marginal_tokens) == (5, 20.0)
    assert (p.metrics.price_free_tokens, p.metrics.price_source) == (5, "prior")
    truth, now = ForwardCost(12, 6.0), 0.0
    for i in range(REFIT_EVERY * 8 + 1):
        tokens = 1 + i % 40
        p._time_step(_shape(tokens), now)
        now += 0.01 * truth(tokens)
    assert (p.cost.free_tokens, p.cost.marginal_tokens) == (p.prices.prices.free_tokens, p.prices.prices.marginal_tokens)
    assert abs(p.cost.free_tokens - 12) <= 1 and p.cost.marginal_tokens == pytest.approx(6.0, rel=0.1)
    m = p.metrics.snapshot()
    assert m["price_source"] == "fitted" and m["price_free_tokens"] == p.cost.free_tokens
    assert m["price_samples"] > 0 and m["price_step_seconds"] == pytest.approx(0.01, rel=0.05)


def test_only_pure_decode_steps_without_idle_gaps_are_priced():
    from lookahead_vllm.core.prices import REFIT_EVERY

    p = make_proposer(cost_free_tokens=-1)
    now = 0.0
    for i in range(REFIT_EVERY * 4):
        prefill = i % 2 == 0  # every other step carries a prefill chunk (slow: 1 s)
        p._time_step(_shape(1 + i % 8, pure=not prefill), now)
        now += 1.0 if prefill else 0.01
    assert p.prices.observed == REFIT_EVERY * 2 - 1  # the decode steps only (the first has no start)
    p._time_step(_shape(3, continuing=False), now + 100.0)  # the engine idled 100 s: no sample
    assert p.prices.observed == REFIT_EVERY * 2 - 1
    tokens, _, seconds, _, _, _ = p.prices.buckets()
    assert seconds.max() < 0.02
    p._time_step(_shape(4, drafted=False), now + 100.01)  # the 3-token step before it: one sample
    assert p.prices.observed == REFIT_EVERY * 2


def test_draftless_steps_teach_the_draft_setup():
    """Steps without drafts run the plain sampler path: they are samples of
    their own kind, and the fit reads the drafted steps' extra time as the
    draft setup (here 0.2 forwards) that the planner then charges."""
    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_vllm.core.prices import REFIT_EVERY

    p = make_proposer(cost_free_tokens=-1)
    assert p.cost.draft_setup == 0.05  # the CPU prior
    truth, now = ForwardCost(5, 20.0, draft_setup=0.2), 0.0
    for i in range(REFIT_EVERY * 12 + 1):
        drafted = i % 3 != 0
        tokens = 1 + i % 24 if drafted else 1 + i % 6
        p._time_step(_shape(tokens, drafted=drafted), now)
        now += 0.01 * (truth.drafted(tokens) if drafted else truth(tokens))
    fit = p.prices.prices
    drafted = p.prices.buckets()[4]
    assert drafted.any() and not drafted.all()  # both kinds among the buckets
    assert fit.draft_setup == pytest.approx(0.2, abs=0.03) and p.cost.draft_setup == fit.draft_setup
    assert p.metrics.snapshot()["price_draft_setup"] == fit.draft_setup


def test_steps_of_many_rows_teach_the_row_price():
    """Rows cost on their own (here 0.1 forwards each past the first): the
    fit separates them from the tokens' price, and a step of many rows then
    plans with its draft tokens cheaper relative to it (ForwardCost.at_rows)."""
    from lookahead_vllm.core.budget import ForwardCost
    from lookahead_vllm.core.prices import REFIT_EVERY

    p = make_proposer(cost_free_tokens=-1)
    assert p.cost.per_row == 0.04  # the CPU prior
    now = 0.0
    for i in range(REFIT_EVERY * 12 + 1):
        rows, per_row = 1 + i % 8, 1 + (i // 8) % 3  # 1-8 rows of 1-3 tokens
        tokens = rows * per_row
        p._time_step(_shape(tokens, rows=rows), now)
        now += 0.01 * (1 + 0.1 * (rows - 1) + max(0, tokens - 5) / 20 + 0.05)
    fit = p.prices.prices
    assert fit.row_price == pytest.approx(0.1, abs=0.03) and p.cost.per_row == fit.row_price
    assert fit.marginal_tokens == pytest.approx(20.0, rel=0.2)
    assert p.metrics.snapshot()["price_row"] == fit.row_price
    step = p.cost.at_rows(8)
    assert step.marginal_tokens == pytest.approx(p.cost.marginal_tokens * (1 + 7 * fit.row_price))
    assert p.cost.at_rows(1) is p.cost and ForwardCost(5, 20.0).at_rows(8) == ForwardCost(5, 20.0)


def test_long_contexts_teach_the_context_price():
    """A row that carries drafts pays for its context (here 0.15 forwards per
    thousand tokens): the fit learns it from drafted steps at several
    contexts, and the planner then drops a long-context row's draft that a
    short-context row with the same confidences keeps."""
    from lookahead_vllm.core.prices import REFIT_EVERY

    p = make_proposer(cost_free_tokens=-1)
    assert p.cost.per_context == 0.08  # the CPU prior
    now = 0.0
    for i in range(REFIT_EVERY * 12 + 1):
        drafted = i % 4 != 0
        rows = 1 + i % 4
        context = 1000 * (1 + (i // 4) % 5) * rows if drafted else 0  # every drafted row 1-5k tokens
        tokens = rows + (2 * rows if drafted else 0)
        p._time_step(_shape(tokens, drafted=drafted, rows=rows, context=context), now)
        now += 0.01 * (1 + 0.04 * (rows - 1) + max(0, tokens - 5) / 20 + (0.05 + 0.15 * context / 1000) * drafted)
    fit = p.prices.prices
    assert fit.context_price == pytest.approx(0.15, abs=0.03) and p.cost.per_context == fit.context_price
    assert p.metrics.snapshot()["price_context"] == fit.context_price
    entry = p.cost.entry(np.array([500, 6000]))
    assert entry.tolist() == pytest.approx([0.5 * fit.context_price, 6.0 * fit.context_price], rel=1e-9)
    from lookahead_lab.reference.planner import allocate_step_budget

    # Two rows with the same 3-node draft (1.2 tokens expected): the 500-token row keeps it, the 6000-token one
    # (entry ~0.9 forwards, 1.8 tokens at the draftless rate) not.
    assert allocate_step_budget([[0.6, 0.4, 0.2], [0.6, 0.4, 0.2]], None, 2, p.cost, entry=entry.tolist()) == [3, 0]
    assert allocate_step_budget([[0.6, 0.4, 0.2], [0.6, 0.4, 0.2]], None, 2, p.cost) == [3, 3]


def test_pinned_prices_are_not_fitted():
    for pinned in ({"cost_free_tokens": 8}, {"cost_marginal_tokens": 30.0}, {"cost_free_tokens": 0}):
        p = make_proposer(**pinned)
        assert p.prices is None
        p._time_step = None  # on_step must not time steps at all
        p.on_step(SimpleNamespace(req_ids=[]), (), None, _shape(4))
        assert p.metrics.price_source == "pinned"
    p = make_proposer(cost_free_tokens=8)
    assert (p.cost.free_tokens, p.cost.marginal_tokens, p.metrics.price_free_tokens) == (8, 20.0, 8)


def test_ranks_take_rank_zeros_prices(monkeypatch):
    """With tensor parallelism every rank prices with rank 0's fit, whatever its own clock said."""
    import vllm.distributed as dist

    from lookahead_vllm.core.prices import REFIT_EVERY

    sent = []

    class Group:
        def broadcast_object(self, obj, src=0):
            sent.append((obj, src))
            return (7, 11.0, 0.125, 0.03, 0.2)  # rank 0's prices

    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_tp_group", lambda: Group())
    p = make_proposer(cost_free_tokens=-1)
    now = 0.0
    for i in range(REFIT_EVERY):
        p._time_step(_shape(1 + i % 20), now)
        now += 0.01
    p._time_step(_shape(1), now)
    assert sent and sent[0][1] == 0
    assert (p.cost.free_tokens, p.cost.marginal_tokens, p.cost.draft_setup, p.cost.per_row,
            p.cost.per_context) == (7, 11.0, 0.125, 0.03, 0.2)


def test_graph_tokens_read_from_the_compilation_config():
    from lookahead_vllm.vllm.proposer import graph_tokens

    def config(eager, mode, size):
        return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager),
                               compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=size))

    assert graph_tokens(config(False, SimpleNamespace(name="PIECEWISE"), 512)) == 512
    assert graph_tokens(config(True, SimpleNamespace(name="PIECEWISE"), 512)) == 0  # eager: no graphs
    assert graph_tokens(config(False, SimpleNamespace(name="NONE"), 512)) == 0
    assert graph_tokens(SimpleNamespace()) == 0


def test_drafts_stop_at_the_largest_cuda_graph():
    """A step past the largest captured graph ran eager at 2-3x the time on an H200: the whole
    step's drafts stay within it (rows + drafts <= graph tokens), and within step_draft_budget."""
    proposer = make_proposer(k=8)
    rows = {f"r{i}": A for i in range(4)}
    lens = {r: 5 for r in rows}
    uncapped = sum(len(d) for d in step(proposer, rows, lens))
    assert uncapped > 12  # every row drafts several tokens on its own repeats
    capped = make_proposer(k=8)
    capped._graph_tokens = 4 + 6  # 4 rows: room for 6 drafts
    assert capped._step_budget(4) == 6 and capped._step_budget(10) is None
    assert sum(len(d) for d in step(capped, rows, lens)) == 6
    both = make_proposer(k=8, step_draft_budget=3)
    both._graph_tokens = 10
    assert both._step_budget(4) == 3


def test_full_graph_tokens_round_capture_sizes_as_vllm_does():
    """vLLM 0.32 rounds capture sizes up to multiples of 1 + k and drops those past the largest:
    with the sizes bench_gpu captures and k = 16, the largest full graph holds 391 tokens, not 512."""
    from lookahead_vllm.vllm.proposer import full_graph_tokens

    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]

    def config(full, eager=False):
        mode = SimpleNamespace(name="FULL_AND_PIECEWISE" if full else "PIECEWISE", has_full_cudagraphs=lambda: full,
                               separate_routine=lambda: full)
        return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager),
                               compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=512,
                                                                  cudagraph_capture_sizes=sizes))

    assert full_graph_tokens(config(True), 16) == 391  # round_up(384, 17); round_up(512, 17) = 527 > 512
    assert full_graph_tokens(config(True), 8) == 387  # round_up(384, 9)
    assert full_graph_tokens(config(True), 1) == 512
    assert full_graph_tokens(config(False), 16) == 0  # piecewise only (tree verification's engines)
    assert full_graph_tokens(config(True, eager=True), 16) == 0
    # Uniform steps only where decode steps have graphs apart from the rest: with FULL every
    # step replays one (FlashAttention 3 captures ragged batches too) and nothing is filled.
    from lookahead_vllm.vllm.proposer import separate_decode_graphs

    assert separate_decode_graphs(config(True))
    single = config(True)
    single.compilation_config.cudagraph_mode = SimpleNamespace(name="FULL", has_full_cudagraphs=lambda: True,
                                                               separate_routine=lambda: False)
    assert full_graph_tokens(single, 16) == 391 and not separate_decode_graphs(single)


def test_uniform_steps_fill_every_row_to_k_keeping_the_planned_draft():
    """Where a full graph holds the step, every row carries exactly k tokens, its planned draft
    first; where rows x (1 + k) would not fit, the drafts stay as planned."""
    k = 8
    rows = {"a": A, "b": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 9, 2, 3], "c": [7, 8, 9, 10]}
    lens = {r: 3 for r in rows}
    planned = step(make_proposer(k=k), rows, lens)
    assert any(0 < len(d) < k for d in planned) and any(len(d) == 0 for d in planned)
    filled_proposer = make_proposer(k=k)
    filled_proposer._uniform_tokens = 3 * (1 + k)
    filled = step(filled_proposer, rows, lens)
    assert [len(d) for d in filled] == [k, k, k]
    for plan, fill, committed in zip(planned, filled, rows.values()):
        assert fill[:len(plan)] == plan
        # a row with no draft repeats its last token
        assert plan or fill == [committed[-1]] * k
    assert filled_proposer.stats.uniform_steps == 1
    assert filled_proposer.stats.fill_tokens == sum(k - len(d) for d in planned)
    too_small = make_proposer(k=k)
    too_small._uniform_tokens = 3 * (1 + k) - 1
    assert step(too_small, rows, lens) == planned and too_small.stats.uniform_steps == 0


def test_uniform_steps_leave_a_request_capped_below_k_alone():
    """A request's own cap (``lookahead_max_draft_tokens``, ``lookahead_enabled``) wins over the
    graph: such a step cannot be uniform, so nothing is filled."""
    p = make_proposer(k=4)
    p._uniform_tokens = 2 * (1 + 4)
    p.on_new_requests([
        SimpleNamespace(req_id="b", sampling_params=SimpleNamespace(extra_args={"lookahead_max_draft_tokens": 2})),
    ])
    drafts = step(p, {"a": A + [1], "b": B + [7]}, {"a": len(A), "b": len(B)})
    assert [len(d) for d in drafts] == [4, 2] and p.stats.uniform_steps == 0


def test_tree_results_book_every_tree_and_feed_the_windows_of_live_requests():
    """One step's TreeResults, trees in any order: every tree counted (nodes verified, tokens
    emitted, accepted nodes off their depth's row), and the Jacobi windows fed only for the trees
    that carry one and whose request still holds state, each with its own accepted nodes."""
    from lookahead_lab.reference.trees import tree_results

    p = make_proposer(k=16, source="index+jacobi", jacobi_window=3, jacobi_ngram=3)
    for req_id in ("a", "b", "gone"):
        p.on_new_requests([SimpleNamespace(req_id=req_id, sampling_params=None)])
    p.finish("gone")
    calls = []
    p.drafter.jacobi = SimpleNamespace(update=lambda *args: calls.append([np.asarray(a).tolist() for a in args]) or 5)
    p.on_tree_results(tree_results([("a", 6, [0, 2, 3], None), ("b", 9, [0, 1], [7, 8, 9]),
                                    ("gone", 4, [1], [4, 5, 6]), ("a", 3, [], [1, 2, 3])]))
    s = p.stats
    assert (s.tree_request_steps, s.tree_nodes, s.tree_tokens) == (4, 22, 6 + 4)
    assert s.tree_off_chain_accepts == 3  # "a"'s nodes 2, 3 at depths 1, 2; "gone"'s node 1 at depth 0
    slot_a, slot_b = p.request_state("a").slot, p.request_state("b").slot
    assert calls == [[[slot_b, slot_a], [[7, 8, 9], [1, 2, 3]], [0, 1], [0, 2, 2]]]
    assert s.pool_ngrams_added == 5


@pytest.mark.parametrize("hybrid, attention_free, scheduled, draftless", [
    (False, False, {"a": [], "b": []}, True),  # no draft in the step: plain decoding
    (False, False, {"a": [], "b": [5]}, False),  # a draft: the speculative path
    (True, False, {"a": [], "b": []}, False),  # recurrent layers read the path's per-row draft counts
    (False, True, {}, False),
])
def test_a_step_runs_draftless_only_without_drafts_or_recurrent_layers(hybrid, attention_free, scheduled, draftless):
    """patches.runs_draftless: on a model with Mamba, GDN or linear-attention layers vLLM's
    speculative path sets each decode row's draft count (0 without drafts) that those layers
    apply the accepted tokens' offset from, so no step of such a model hides it."""
    from lookahead_vllm.vllm.patches import runs_draftless

    model = SimpleNamespace(is_hybrid=hybrid, is_attention_free=attention_free)
    runner = SimpleNamespace(drafter=make_proposer(), model_config=model)
    output = SimpleNamespace(scheduled_spec_decode_tokens=scheduled)
    assert runs_draftless(runner, output) is draftless
    assert runs_draftless(SimpleNamespace(drafter=object(), model_config=model), output) is False  # not lookahead's


def test_lookahead_drafts_whatever_the_batchs_longest_request():
    """patches.drafter_near_max_len: vLLM runs a drafter only while the longest sequence plus
    k tokens fits max_model_len, else it schedules k zero tokens for every row; lookahead caps
    each row itself (test_rows_without_sample_or_at_max_len_get_no_draft), so it always runs."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lookahead_vllm.vllm import patches

    assert patches.apply("drafter_near_max_len"), patches._failed
    near = SimpleNamespace(max_seq_len=MAX_LEN - 1)  # one row 1 token short of max_model_len
    vllm_drafter = SimpleNamespace(num_spec_tokens=4, effective_drafter_max_model_len=MAX_LEN, drafter=object(),
                                   speculative_config=SimpleNamespace(use_dflash=lambda: False))
    assert GPUModelRunner._input_fits_in_drafter(vllm_drafter, near) is False  # vLLM's own rule, for others
    ours = SimpleNamespace(**{**vars(vllm_drafter), "drafter": make_proposer()})
    assert GPUModelRunner._input_fits_in_drafter(ours, near) is True
    assert GPUModelRunner._input_fits_in_drafter(ours, None) is False  # no metadata: vLLM's rule
