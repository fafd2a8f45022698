"""Salted partitions are recycled (core/partitions.py): a partition that holds no running
request and no output gives its id back, the lowest freed id goes to the next new salt, a
partition still holding outputs keeps its id (so a new salt never drafts an old one's
outputs), and past MAX_PARTITION ids in use a new salt drafts PRIVATE."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_vllm.core import partitions as module
from lookahead_vllm.core.draft_index import DEFAULT, PRIVATE
from lookahead_vllm.core.drafter import Drafter
from lookahead_vllm.core.partitions import SWEEP_FIRST, Partitions, salt_label
from tests.settings import lookahead_settings


def test_released_ids_are_reused_lowest_first_and_their_labels_dropped():
    parts = Partitions("per-salt-saved")
    assert [parts.of_salt(s) for s in ("a", "b", "c", None, "a")] == [1, 2, 3, DEFAULT, 1]
    assert parts.release(in_use=[2]) == 2 and parts.labelled == 2  # "a" and "c" held nothing
    assert parts.saved() == [DEFAULT, 2] and parts.label(2) == salt_label("b")
    assert [parts.of_salt(s) for s in ("d", "e", "f", "b")] == [1, 3, 4, 2]
    assert parts.of_salt("a") == 5 and parts.of_label(salt_label("c")) == 6  # dropped labels: new ids
    assert parts.release(in_use=range(7)) == 0 and parts.labelled == 7


def test_a_sweep_falls_due_at_twice_what_the_last_one_kept():
    parts = Partitions()
    for i in range(SWEEP_FIRST - 2):
        parts.of_salt(f"s{i}")
    assert not parts.sweep_due()
    parts.of_salt("one more")
    assert parts.sweep_due()  # SWEEP_FIRST labelled, the default one included
    parts.release(in_use=range(SWEEP_FIRST))  # every one still in use
    assert not parts.sweep_due()
    for i in range(SWEEP_FIRST):
        parts.of_salt(f"t{i}")
    assert parts.labelled == 2 * SWEEP_FIRST and parts.sweep_due()


def test_with_every_id_in_use_a_new_salt_drafts_private(monkeypatch):
    monkeypatch.setattr(module, "MAX_PARTITION", 2)
    parts = Partitions()
    assert [parts.of_salt(s) for s in ("a", "b", "c")] == [1, 2, PRIVATE]
    parts.release(in_use=[2])
    assert parts.of_salt("c") == 1


def _serve(drafter: Drafter, slot: int, salt: str, text: list[int], prompt_len: int) -> int:
    """One request of ``salt``: admitted with its whole text, finished; returns its partition."""
    partition = drafter.partition(salt)
    drafter.sync([slot], [0], np.asarray([text], np.int64), [len(text)], [prompt_len], [partition])
    drafter.finish(slot)
    return partition


def _draft(drafter: Drafter, slot: int, salt: str, prompt: list[int]) -> list[int]:
    partition = drafter.partition(salt)
    drafter.sync([slot], [0], np.asarray([prompt], np.int64), [len(prompt)], [len(prompt)], [partition])
    tokens, _, _, lengths = drafter.draft_rows(np.array([slot]), np.array([5]), 0.0, False)
    drafter.finish(slot)
    return tokens[0, :lengths[0]].tolist()


@pytest.mark.parametrize("cap", [0, 1 << 20])
def test_only_a_partition_that_holds_nothing_is_freed(cap):
    """With outputs kept (cap 1 MiB) "a"'s partition stays: "b" gets another id and does
    not draft "a"'s secret; with none kept (cap 0) its id goes to "b", which still drafts
    nothing of it."""
    drafter = Drafter(lookahead_settings(index_corpus_bytes=cap))
    prompt, secret = [1, 2, 3, 4], [50, 51, 52, 53, 54]
    a = _serve(drafter, 0, "a", [9] + prompt + secret, 1)
    assert _draft(drafter, 1, "a", prompt) == (secret if cap else [])
    running_c = drafter.partition("c")  # admitted, not synced yet: the caller holds its state
    assert drafter.release_partitions(held=[running_c]) == (0 if cap else 1)
    b = drafter.partition("b")
    assert (b == a) is (cap == 0) and b != running_c
    assert _draft(drafter, 2, "b", prompt) == []
    assert drafter.partition("a") == (a if cap else 3)


def test_a_salt_per_request_keeps_the_partitions_bounded():
    """4 x SWEEP_FIRST salts, one request each, outputs evicted as they come (a tiny cap):
    through the proposer's sweeps the labels and each index's partition records stay
    bounded, where without recycling each salt kept one forever."""
    from types import SimpleNamespace

    from lookahead_lab.standalone import standalone_proposer
    from tests.settings import lookahead

    p = standalone_proposer(4, 64, lookahead(index_corpus_bytes=1, cost_free_tokens=0))
    most = 0
    for i in range(4 * SWEEP_FIRST):
        rid = f"r{i}"
        p.on_new_requests([SimpleNamespace(req_id=rid, sampling_params=None, cache_salt=f"user{i}")])
        batch = SimpleNamespace(req_ids=[rid], num_prompt_tokens=np.array([3]))
        p.on_step(batch, (), None)
        p.propose([[3]], np.array([4]), np.array([[1, 2, 3, i % 7]], np.int64))
        p.on_step(SimpleNamespace(req_ids=[], num_prompt_tokens=np.array([], np.int64)), [rid], None)
        most = max(most, p.drafter.partitions.labelled)
    assert most <= SWEEP_FIRST + 1
    assert p.drafter.partition("user0") <= SWEEP_FIRST  # a reused id, not the 1025th
