"""Draft index partitions (tenant isolation, core/draft_index.py): a sequence
drafts from its own text and its own partition's outputs only, PRIVATE ones
from their own text alone; the corpus cap holds over all partitions and
evicts the partition charged the most first. The reference and the native
index are held to the same results."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lookahead_lab.reference.draft_index import DraftIndex
from lookahead_vllm.core import native
from lookahead_vllm.core.draft_index import DEFAULT, MAX_PARTITION, PRIVATE, SEQUENCE_CHARGE, DraftIndexConfig
from tests.settings import index_config

KINDS = ["reference", "native"]
PARTS = [PRIVATE, DEFAULT, 1, 2]
# Partition p's texts use tokens VOCAB * (p + 1) .. VOCAB * (p + 2) - 1 (PRIVATE: 0 ..).
VOCAB = 3


def _make(kind: str, cfg: DraftIndexConfig = index_config(ngram=2)):
    return native.make_draft_index(cfg) if kind == "native" else DraftIndex(cfg)


def _text(rng: np.random.Generator, part: int, n: int) -> list[int]:
    return (VOCAB * (part + 1) + rng.integers(0, VOCAB, n)).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_a_partition_never_drafts_anothers_output(kind):
    """Same prompt in two partitions; the first one's continuation (its
    "secret") is drafted to its own partition only."""
    index = _make(kind)
    prompt, secret = [1, 2, 3, 4], [50, 51, 52, 53, 54]
    index.add(0, [9] + prompt + secret, 1, partition=1)  # its output: the prompt's text, then the secret
    index.finish(0)
    for sid, part in ((1, 1), (2, 2), (3, DEFAULT), (4, PRIVATE)):
        index.add(sid, prompt, 4, partition=part)
    tokens, _, _, lengths = index.draft_batch([1, 2, 3, 4], [5] * 4)
    assert tokens[0, :lengths[0]].tolist() == secret
    assert lengths[1:].tolist() == [0, 0, 0]
    # The control: in one partition the same request does draft the secret.
    shared = _make(kind)
    shared.add(0, [9] + prompt + secret, 1)
    shared.finish(0)
    shared.add(1, prompt, 4)
    assert shared.draft(1, 5)[0] == secret


@pytest.mark.parametrize("kind", KINDS)
def test_private_sequences_keep_nothing(kind):
    index = _make(kind)
    index.add(0, [1, 2, 3, 1, 2], 2, partition=PRIVATE)
    assert index.draft(0, 3)[0] == [3, 1, 2]  # its own text still drafts
    assert index.partition_bytes() == {}
    index.finish(0)
    assert (index.num_sequences(), index.corpus_bytes(), index.corpus_sequences()) == (0, 0, [])


@pytest.mark.parametrize("kind", KINDS)
def test_partitions_are_checked(kind):
    index = _make(kind)
    for bad in (-2, MAX_PARTITION + 1):
        with pytest.raises(ValueError, match=f"partition={bad}"):
            index.add(0, [1, 2], 1, partition=bad)
    table = np.zeros((1, 4), np.int64)
    with pytest.raises(ValueError, match="partition"):
        index.sync([0], [0], table, [2], [1], partitions=[-5])
    with pytest.raises(ValueError, match="same length"):
        index.sync([0], [0], table, [2], [1], partitions=[1, 2])


@pytest.mark.parametrize("kind", KINDS)
def test_a_flood_evicts_its_own_partition_first(kind):
    """Partition 1 floods the corpus; partition 2's outputs, charged less,
    all stay, and the cap holds."""
    cap = 40_000
    index = _make(kind, index_config(ngram=2, corpus_bytes=cap))
    rng = np.random.default_rng(0)
    kept = []
    for i in range(4):
        kept.append(_text(rng, 2, 30))
        index.add(1000 + i, [0] + kept[-1], 1, partition=2)
        index.finish(1000 + i)
    for i in range(200):
        index.add(i, [0] + _text(rng, 1, 120), 1, partition=1)
        index.finish(i)
        index.settle()
        assert index.corpus_bytes() <= cap
    assert index.corpus_sequences(2) == kept
    charge = index.partition_bytes()
    assert set(charge) == {1, 2} and sum(charge.values()) == index.corpus_bytes()
    assert charge[1] > charge[2]
    # One shared partition: the same flood evicts the others' outputs.
    shared = _make(kind, index_config(ngram=2, corpus_bytes=cap))
    for i, text in enumerate(kept):
        shared.add(1000 + i, [0] + text, 1)
        shared.finish(1000 + i)
    rng = np.random.default_rng(0)
    for i in range(200):
        shared.add(i, [0] + _text(rng, 1, 120), 1)
        shared.finish(i)
    assert not any(text in shared.corpus_sequences() for text in kept)


@pytest.mark.parametrize("kind", KINDS)
def test_eviction_ties_go_to_the_lowest_partition(kind):
    index = _make(kind, index_config(ngram=2, corpus_bytes=0))
    index.add(0, [7, 7], 0, partition=3)
    index.add(1, [7, 7], 0, partition=1)
    index.finish(0)
    index.finish(1)
    index.settle()  # both outputs are charged alike; the cap takes both, partition 1's first
    assert index.corpus_sequences() == [] and index.corpus_bytes() == 0
    big = _make(kind, index_config(ngram=2, corpus_bytes=SEQUENCE_CHARGE + 16))
    big.add(0, [7, 7], 0, partition=3)
    big.add(1, [7, 7], 0, partition=1)
    big.finish(0)
    big.finish(1)
    assert big.corpus_sequences(3) == [[7, 7]] and big.corpus_sequences(1) == []


def _partitioned_ops(data, indexes, vocab_parts):
    """Random adds (into random partitions), extends, finishes, rewinds,
    syncs and drafts on every index in ``indexes``; returns each sid's partition."""
    partition_of: dict[int, int] = {}
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    for _ in range(data.draw(st.integers(5, 40))):
        op = data.draw(st.sampled_from(["add", "add", "extend", "finish", "rewind", "sync", "batch"]))
        sid = data.draw(st.integers(0, 7))
        live = indexes[0].length(sid) >= 0
        if op == "add" and not live and sid not in partition_of:
            part = data.draw(st.sampled_from(vocab_parts))
            partition_of[sid] = part
            tokens = _text(rng, part, data.draw(st.integers(0, 12)))
            plen = data.draw(st.integers(0, len(tokens)))
            for index in indexes:
                index.add(sid, tokens, plen, partition=part)
        elif op == "extend" and live:
            tokens = _text(rng, partition_of[sid], data.draw(st.integers(0, 6)))
            for index in indexes:
                index.extend(sid, tokens)
        elif op == "finish":
            for index in indexes:
                index.finish(sid)
        elif op == "rewind" and live:
            length = data.draw(st.integers(0, 14))
            for index in indexes:
                index.rewind(sid, length)
        elif op == "sync":
            new = [s for s in range(8, 12) if s not in partition_of][:2]
            parts = [data.draw(st.sampled_from(vocab_parts)) for _ in new]
            partition_of.update(zip(new, parts))
            texts = [_text(rng, p, data.draw(st.integers(1, 10))) for p in parts]
            table = np.zeros((max(1, len(new)), 12), np.int64)
            for row, text in enumerate(texts):
                table[row, :len(text)] = text
            for index in indexes:
                index.sync(new, list(range(len(new))), table, [len(t) for t in texts], [1] * len(new),
                           partitions=parts)
        elif op == "batch":
            sids = sorted(partition_of)
            tree = data.draw(st.booleans())
            outs = [index.draft_batch(sids, [6] * len(sids), 0.0, tree) for index in indexes]
            for out in outs[1:]:
                for a, b in zip(outs[0], out):
                    assert np.array_equal(a, b)
            tokens, _, _, lengths = outs[0]
            for row, sid in enumerate(sids):  # drafted tokens come from its partition's vocabulary only
                part = partition_of[sid]
                drafted = tokens[row, :lengths[row]]
                assert ((drafted >= VOCAB * (part + 1)) & (drafted < VOCAB * (part + 2))).all(), (sid, part)
    return partition_of


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus=st.integers(0, 3000), upkeep_thread=st.booleans(), data=st.data())
def test_random_partitioned_operations(corpus, upkeep_thread, data):
    """Drafts never leave a partition, and the native index matches the
    reference: drafts, each partition's corpus and charge, the total."""
    cfg = index_config(ngram=2, max_match=5, max_occurrences=3, max_candidates=4, corpus_bytes=corpus)
    indexes = [DraftIndex(cfg), native.make_draft_index(cfg, upkeep_thread=upkeep_thread)]
    _partitioned_ops(data, indexes, PARTS)
    ref = indexes[0]
    for index in indexes[1:]:
        assert index.partition_bytes() == ref.partition_bytes()
        assert index.corpus_bytes() == ref.corpus_bytes()
        for part in (None, *PARTS):
            assert index.corpus_sequences(part) == ref.corpus_sequences(part)
        assert index.num_sequences() == ref.num_sequences()
