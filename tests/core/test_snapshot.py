"""Drafter snapshots (core/snapshot.py): a round trip drafts identically
(reference and native index, trie source too); truncated, corrupt and foreign
files are refused before anything is learned; writes are atomic."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from lookahead_lab.reference import drafter, padded_contexts, row_drafts
from lookahead_lab.reference.draft_index import DraftIndex
from lookahead_vllm.core import snapshot
from lookahead_vllm.core.drafter import Drafter
from lookahead_vllm.core.snapshot import SnapshotError, identity_of, read_snapshot
from tests.settings import index_config, lookahead_settings

IDENTITY = identity_of("/models/SmolLM2-135M-Instruct-fp32/", 49152)
BACKENDS = [False, True]


def _traffic(seed: int, n: int = 12, vocab: int = 12) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs with repeats inside and across requests."""
    rng = np.random.default_rng(seed)
    motifs = [rng.integers(0, vocab, 6).tolist() for _ in range(4)]
    pairs = []
    for _ in range(n):
        prompt = sum((motifs[i] for i in rng.integers(0, 4, 2)), [])
        output = sum((motifs[i] + rng.integers(0, vocab, 1).tolist() for i in rng.integers(0, 4, 4)), [])
        pairs.append((prompt, output))
    return pairs


def _serve(drafter: Drafter, pairs, first_slot: int = 0) -> None:
    """Each request: admitted, its output committed in three steps, finished."""
    for slot, (prompt, output) in enumerate(pairs, first_slot):
        text = prompt + output
        table = np.asarray([text], np.int64)
        for n in (len(prompt) + 1, len(prompt) + len(output) // 2, len(text)):
            drafter.sync([slot], [0], table, [n], [len(prompt)])
        drafter.finish(slot)


def _drafts(drafter: Drafter, probes, tree: bool) -> list[tuple]:
    out = []
    for slot, probe in enumerate(probes, 10_000 + 1000 * tree):  # finished slots stay taken
        drafter.sync([slot], [0], np.asarray([probe], np.int64), [len(probe)], [len(probe) - 2])
        context = probe[-drafter.config.profile.max_match_length:]
        (t, _), = row_drafts(drafter.draft([slot], padded_contexts([context]), [8], 0.0, tree))
        out.append((t.tokens, t.parents, t.weights, t.confidence))
        drafter.finish(slot)
    return out


@pytest.mark.parametrize("use_native", BACKENDS)
@pytest.mark.parametrize("source", ["index", "index+trie", "trie"])
def test_round_trip_drafts_identically(tmp_path, use_native, source):
    config = lookahead_settings(source=source, draft_shape="hier", index_backoff=1 if source == "index" else 0)
    old = drafter(config, use_native)
    _serve(old, _traffic(0))
    path = tmp_path / "snap.bin"
    written = old.save_snapshot(str(path), IDENTITY)
    new = drafter(config, use_native)
    loaded = new.load_snapshot(str(path), IDENTITY)
    assert loaded.sequences == written.sequences
    if old.index is not None:
        assert new.index.corpus_sequences() == old.index.corpus_sequences() and written.sequences
    if old.trie is not None:
        assert new.trie.output_counts() == old.trie.output_counts()
    probes = [p + o[:k] for (p, o), k in zip(_traffic(1, 8), range(3, 11))]
    for tree in (False, True):
        cold = _drafts(drafter(config, use_native), probes, tree)
        warm_old, warm_new = _drafts(old, probes, tree), _drafts(new, probes, tree)
        assert warm_new == warm_old
        assert warm_new != cold  # the snapshot carries what drafts


def test_native_and_reference_snapshots_are_the_same_bytes(tmp_path):
    config = lookahead_settings()
    snaps = []
    for use_native in (False, True):
        d = drafter(config, use_native)
        _serve(d, _traffic(2))
        snaps.append(snapshot.encode(d.snapshot(IDENTITY)))
    assert snaps[0] == snaps[1]


def test_corpus_sequences_are_the_kept_outputs_oldest_first():
    # Charged 272, 280 and 272 bytes (256 each, and 8 per token; no 3-grams after an output's third token).
    index = DraftIndex(index_config(ngram=3, corpus_bytes=600))
    for sid, (tokens, plen) in enumerate([([1, 2, 3], 1), ([4, 5, 6], 0), ([7, 8, 9, 10], 2)]):
        index.add(sid, tokens, plen)
        index.finish(sid)
    assert index.corpus_sequences() == [[4, 5, 6], [9, 10]]  # [2, 3] evicted over the cap
    index.add(7, [1, 2], 0)  # running sequences are not in it
    assert index.corpus_sequences() == [[4, 5, 6], [9, 10]]


def _written(tmp_path, source="index+trie") -> tuple[str, bytes]:
    d = Drafter(lookahead_settings(source=source))
    _serve(d, _traffic(3))
    path = tmp_path / "snap.bin"
    d.save_snapshot(str(path), IDENTITY)
    return str(path), path.read_bytes()


def _refused(path: str, identity=IDENTITY, config=lookahead_settings(source="index+trie")) -> str:
    d = Drafter(config)
    with pytest.raises(SnapshotError) as err:
        d.load_snapshot(path, identity)
    assert d.index.num_sequences() == 0 and d.trie.num_nodes == 0  # nothing learned
    assert path in str(err.value)  # the message names the file
    return str(err.value)


@pytest.mark.parametrize("keep", [0, 10, 0.5, -1])
def test_truncated_file_is_refused(tmp_path, keep):
    path, data = _written(tmp_path)
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) - 1)
    with open(path, "wb") as f:
        f.write(data[:cut])
    assert "truncated" in _refused(path)


def test_flipped_byte_is_refused(tmp_path):
    path, data = _written(tmp_path)
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0x40
    with open(path, "wb") as f:
        f.write(corrupt)
    assert "checksum" in _refused(path)


def test_foreign_files_are_refused(tmp_path):
    path, data = _written(tmp_path)
    assert "vocab_size=49152" in _refused(path, identity_of("SmolLM2-135M-Instruct-fp32", 32000))
    assert "model='SmolLM2-135M-Instruct-fp32'" in _refused(path, identity_of("Llama-3-8B", 49152))
    for name, patched in (("magic", b"NOTASNAP" + data[8:]),
                          ("version", data[:8] + struct.pack("<I", snapshot.FORMAT_VERSION + 1) + data[12:])):
        with open(path, "wb") as f:
            f.write(patched)
        assert name in _refused(path)
    open(path, "w").write('{"text": "not a snapshot"}\n')
    assert "magic" in _refused(path)


def test_trie_of_another_branch_length_is_refused(tmp_path):
    path, _ = _written(tmp_path)
    message = _refused(path, config=lookahead_settings(source="index+trie", branch_length=8))
    assert "branch_length=12" in message
    Drafter(lookahead_settings(source="index", branch_length=8)).load_snapshot(path, IDENTITY)  # no trie: fine


def test_missing_file_is_refused(tmp_path):
    assert "cannot be read" in _refused(str(tmp_path / "absent.bin"))


def test_write_is_atomic(tmp_path, monkeypatch):
    path, before = _written(tmp_path)
    d = Drafter(lookahead_settings(source="index+trie"))
    _serve(d, _traffic(4, n=30))

    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(snapshot.os, "replace", crash)
    with pytest.raises(OSError):
        d.save_snapshot(path, IDENTITY)
    assert open(path, "rb").read() == before  # the old snapshot, whole
    assert os.listdir(tmp_path) == ["snap.bin"]  # no temporary file left
    monkeypatch.undo()
    d.save_snapshot(path, IDENTITY)
    assert read_snapshot(path, IDENTITY).sequences == d.index.corpus_sequences()
    assert os.listdir(tmp_path) == ["snap.bin"]


def test_empty_drafter_round_trips(tmp_path):
    path = str(tmp_path / "empty.bin")
    Drafter(lookahead_settings()).save_snapshot(path, IDENTITY)
    snap = Drafter(lookahead_settings()).load_snapshot(path, IDENTITY)
    assert snap.sequences == [] and snap.trie is None


@pytest.mark.parametrize("flaw", ["too deep", "nan count", "negative count"])
def test_trie_table_this_trie_could_not_write_is_refused(tmp_path, flaw):
    """A crafted table (checksum right) is refused whole, before the index learns the file's outputs: a path
    deeper than branch_length (saving it again would recurse that deep: 100k rows crashed the process) or a
    count that is not finite and >= 0."""
    import dataclasses

    d = Drafter(lookahead_settings(source="index+trie"))
    _serve(d, _traffic(3))
    n = 13 if flaw == "too deep" else 3
    counts = np.ones(n)
    counts[-1] = {"too deep": 1.0, "nan count": np.nan, "negative count": -1.0}[flaw]
    table = snapshot.TrieTable(np.arange(-1, n - 1, dtype=np.int32), np.full(n, 5, np.int32), counts)
    path = str(tmp_path / "crafted.bin")
    snapshot.write_snapshot(path, dataclasses.replace(d.snapshot(IDENTITY), trie=table))
    message = _refused(path)
    assert ("13 nodes deep: must be at most branch_length=12" if flaw == "too deep" else "must be finite") in message
