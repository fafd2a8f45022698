"""Warm start and snapshots through LookaheadProposer: warm_start files
(JSONL and plain text) are tokenized and learned at start; a proposer loading
a snapshot drafts as the one that wrote it; a bad snapshot starts cold."""

from __future__ import annotations

import gc
import json
import logging
import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest

from lookahead_vllm.core.warm_start import WarmReader
from tests.settings import lookahead

pytestmark = pytest.mark.vllm

MAX_LEN = 256
TEXTS = ["def add(a, b):\n    return a + b", "for i in range(10):\n    print(i * i)",
         "The quick brown fox jumps over the lazy dog."]


def make_proposer(tokenizer_dir: str, dp_rank: int = 0, **fields):
    from lookahead_lab.standalone import engine_free_config
    from lookahead_vllm.vllm.proposer import LookaheadProposer

    fields.setdefault("cost_free_tokens", 0)
    config = engine_free_config(8, MAX_LEN, lookahead(**fields), model=tokenizer_dir, tokenizer=tokenizer_dir)
    config.parallel_config = SimpleNamespace(data_parallel_index=dp_rank)  # vLLM's, in each data-parallel engine
    return LookaheadProposer(config)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def step(proposer, rows: dict[str, list[int]], prompt_lens: dict[str, int], finished=()):
    ids = list(rows)
    batch = SimpleNamespace(req_ids=ids, num_prompt_tokens=np.array([prompt_lens[r] for r in ids]))
    proposer.on_step(batch, finished, None)
    tokens = np.zeros((len(ids), MAX_LEN), dtype=np.int64)
    for i, r in enumerate(ids):
        tokens[i, :len(rows[r])] = rows[r]
    return proposer.propose([[rows[r][-1]] for r in ids], np.array([len(rows[r]) for r in ids]), tokens)


def _probe(proposer, tokenizer, text: str, req: str = "probe") -> list[int]:
    """Draft after the first half of ``text`` as a fresh request's output."""
    ids = tokenizer("Write:", add_special_tokens=False)["input_ids"]
    out = tokenizer(text, add_special_tokens=False)["input_ids"]
    row = ids + out[:len(out) // 2]
    draft = step(proposer, {req: row}, {req: len(ids)})[0]
    step(proposer, {}, {}, finished=[req])
    return draft


def test_warm_texts_formats(tmp_path):
    jsonl = tmp_path / "past.jsonl"
    jsonl.write_text("\n".join([json.dumps({"text": "a"}), "", json.dumps({"response": "b", "id": 1}),
                                json.dumps({"output": 3, "completion": "c"}), "not json", json.dumps(["x"])]))
    found = WarmReader(jsonl)
    assert list(found.texts()) == ["a", "b", "c"] and found.skipped_lines == [5, 6]
    plain = tmp_path / "corpus.txt"
    plain.write_text("first para\nline two\n\n  \nsecond\n\n\nthird  \n")
    assert list(WarmReader(plain).texts()) == ["first para\nline two", "second", "third"]


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_warm_start_file_is_learned(tmp_path, smollm2_dir, tokenizer, kind):
    path = tmp_path / f"past.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"completion": t}) + "\n" for t in TEXTS))
    else:
        path.write_text("\n\n".join(TEXTS) + "\n")
    cold = make_proposer(smollm2_dir)
    warm = make_proposer(smollm2_dir, warm_start=str(path))
    assert warm.drafter.index.corpus_sequences() == [
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert cold.drafter.index.corpus_sequences() == []
    want = tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    draft = _probe(warm, tokenizer, TEXTS[0])
    assert draft and want[len(want) // 2:][:len(draft)] == draft  # drafts the rest of the past response
    assert _probe(cold, tokenizer, TEXTS[0]) == []



def test_a_big_warm_start_file_is_learned_batch_by_batch_with_progress(tmp_path, smollm2_dir, tokenizer, monkeypatch,
                                                                       caplog):
    """Texts are tokenized and learned a batch at a time as the file streams (each learned in file
    order, none lost at a batch's edge), and a long warm start logs its progress in MiB read."""
    from lookahead_vllm.vllm import persistence

    monkeypatch.setattr(persistence, "TOKENIZE_BATCH", 2)
    monkeypatch.setattr(persistence, "PROGRESS_EVERY_S", 0.0)
    texts = [f"{t} #{i}" for i in range(3) for t in TEXTS] + ["odd one out"]
    path = tmp_path / "past.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with caplog.at_level(logging.INFO):
        warm = make_proposer(smollm2_dir, warm_start=str(path))
    assert warm.drafter.index.corpus_sequences() == [tokenizer(t, add_special_tokens=False)["input_ids"]
                                                     for t in texts]
    progress = [r.getMessage() for r in caplog.records if "MiB read" in r.getMessage()]
    assert len(progress) == -(-len(texts) // 2)  # one line a batch here
    assert ": 2 texts learned" in progress[0] and f": {len(texts)} texts learned" in progress[-1]
    assert warm._persistence.learned["warm_start"][0] == len(texts)
@pytest.mark.parametrize("source", ["index", "index+trie"])
def test_snapshot_round_trip_through_proposers(tmp_path, smollm2_dir, tokenizer, source):
    snap = tmp_path / "snap" / "learned.bin"
    first = make_proposer(smollm2_dir, source=source, snapshot_path=str(snap))
    assert not snap.exists()
    prompt = tokenizer("Write:", add_special_tokens=False)["input_ids"]
    for i, text in enumerate(TEXTS):  # serve: the outputs are learned
        out = tokenizer(text, add_special_tokens=False)["input_ids"]
        for n in (1, len(out) // 2, len(out)):
            step(first, {f"r{i}": prompt + out[:n]}, {f"r{i}": len(prompt)})
        step(first, {}, {}, finished=[f"r{i}"])
    first.close()  # engine shutdown
    assert snap.exists()
    second = make_proposer(smollm2_dir, source=source, snapshot_path=str(snap))
    assert second.drafter.index.corpus_sequences() == first.drafter.index.corpus_sequences()
    for j, text in enumerate(TEXTS):
        d1, d2 = _probe(first, tokenizer, text, f"p{j}"), _probe(second, tokenizer, text, f"p{j}")
        assert d1 and d2 == d1


def test_snapshot_written_when_the_proposer_is_collected(tmp_path, smollm2_dir, tokenizer):
    snap = tmp_path / "learned.bin"
    p = make_proposer(smollm2_dir, snapshot_path=str(snap))
    p.warm_start([[5, 6, 7, 8]])
    del p
    gc.collect()
    assert make_proposer(smollm2_dir, snapshot_path=str(snap)).drafter.index.corpus_sequences() == [[5, 6, 7, 8]]


def test_bad_snapshot_starts_cold_with_a_warning(tmp_path, smollm2_dir, caplog):
    """A refused snapshot is kept beside the path (``.refused``, then ``.refused.1``): the
    run's own snapshot, written at shutdown, never overwrites it."""
    snap, garbage = tmp_path / "learned.bin", b"LKAHSNAP\x01\x00\x00\x00garbage"
    snap.write_bytes(garbage)
    (tmp_path / "learned.bin.refused").write_bytes(b"an earlier refusal")
    with caplog.at_level(logging.WARNING):
        p = make_proposer(smollm2_dir, snapshot_path=str(snap))
    assert p.drafter.index.corpus_sequences() == []
    assert any(str(snap) in r.getMessage() and "refused and kept as" in r.getMessage() for r in caplog.records)
    assert not snap.exists() and (tmp_path / "learned.bin.refused.1").read_bytes() == garbage
    assert (tmp_path / "learned.bin.refused").read_bytes() == b"an earlier refusal"
    p.warm_start([[5, 6, 7, 8]])
    p.close()
    assert make_proposer(smollm2_dir, snapshot_path=str(snap)).drafter.index.corpus_sequences() == [[5, 6, 7, 8]]
    assert (tmp_path / "learned.bin.refused.1").read_bytes() == garbage


def test_snapshot_of_another_model_is_refused(tmp_path, smollm2_dir, tiny_llama_dir, caplog):
    """The other model's engine starts cold and writes its own snapshot; the first model's
    snapshot survives it (moved aside) and still loads into that model."""
    snap = tmp_path / "learned.bin"
    p = make_proposer(smollm2_dir, snapshot_path=str(snap))
    p.warm_start([[5, 6, 7, 8]])
    p.close()
    with caplog.at_level(logging.WARNING):
        other = make_proposer(tiny_llama_dir, snapshot_path=str(snap))
    assert other.drafter.index.corpus_sequences() == []
    assert any("vocab_size" in r.getMessage() or "model=" in r.getMessage() for r in caplog.records)
    other.close()
    kept = tmp_path / "learned.bin.refused"
    assert make_proposer(smollm2_dir, snapshot_path=str(kept)).drafter.index.corpus_sequences() == [[5, 6, 7, 8]]


def test_a_refused_snapshot_that_cannot_be_moved_is_never_overwritten(tmp_path, smollm2_dir, monkeypatch, caplog):
    import os

    snap, garbage = tmp_path / "learned.bin", b"LKAHSNAP\x01\x00\x00\x00garbage"
    snap.write_bytes(garbage)

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", refuse)
    with caplog.at_level(logging.WARNING):
        p = make_proposer(smollm2_dir, snapshot_path=str(snap))
    assert any("no snapshot is written" in r.getMessage() and "Permission denied" in r.getMessage()
               for r in caplog.records)
    p.warm_start([[5, 6, 7, 8]])
    p.save_snapshot()
    p.close()
    assert snap.read_bytes() == garbage and sorted(x.name for x in tmp_path.iterdir()) == ["learned.bin"]


def test_warm_start_not_repeated_when_the_snapshot_holds_it(tmp_path, smollm2_dir):
    past = tmp_path / "past.txt"
    past.write_text("\n\n".join(TEXTS))
    snap = tmp_path / "learned.bin"
    first = make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap))
    first.close()
    second = make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap))
    assert second.drafter.index.corpus_sequences() == first.drafter.index.corpus_sequences()
    past.write_text("another text entirely")  # a new file is learned on top
    third = make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap))
    assert len(third.drafter.index.corpus_sequences()) == len(TEXTS) + 1


def test_a_snapshot_never_names_a_warm_start_file_it_does_not_hold(tmp_path, smollm2_dir, monkeypatch, caplog):
    """A warm start that failed part-way (here the tokenizer) is not stamped into the snapshot,
    so the next start learns the file; one that cannot be read is not learned that run
    (the snapshot may hold it already: learning it again would double it), and the snapshot
    written then still names the file it holds."""
    from lookahead_vllm.vllm import persistence

    past = tmp_path / "past.txt"
    past.write_text("\n\n".join(TEXTS))
    snap = tmp_path / "learned.bin"
    with monkeypatch.context() as m:
        m.setattr(persistence.Persistence, "_warm", lambda self, drafter, warm: int("tokenizer failed"))
        make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap)).close()
    learned = make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap))
    assert len(learned.drafter.index.corpus_sequences()) == len(TEXTS)  # learned now, not skipped as held
    learned.close()
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
        m.setattr(persistence, "file_digest", lambda path: (_ for _ in ()).throw(OSError(5, "Input/output error")))
        unread = make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap))
        assert len(unread.drafter.index.corpus_sequences()) == len(TEXTS)  # the snapshot's, not twice
        unread.close()
    assert any("Input/output error" in r.getMessage() and "not learned this run" in r.getMessage()
               for r in caplog.records)
    again = make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap))
    assert len(again.drafter.index.corpus_sequences()) == len(TEXTS)  # still named as held: not read again


def test_missing_warm_start_file_starts_cold(tmp_path, smollm2_dir, caplog):
    with caplog.at_level(logging.WARNING):
        p = make_proposer(smollm2_dir, warm_start=str(tmp_path / "absent.jsonl"))
    assert p.drafter.index.corpus_sequences() == []
    assert any("absent.jsonl" in r.getMessage() for r in caplog.records)


def test_a_snapshot_not_judged_stays_in_place_and_nothing_is_written_over_it(tmp_path, smollm2_dir, monkeypatch,
                                                                           caplog):
    """A passing read failure or a directory at the path is no verdict on the content: the
    file (or directory) stays where it is, the engine starts cold, and no snapshot replaces it."""
    from lookahead_vllm.core import snapshot

    good = make_proposer(smollm2_dir, snapshot_path=str(tmp_path / "learned.bin"))
    good.warm_start([[5, 6, 7, 8]])
    good.close()
    written = (tmp_path / "learned.bin").read_bytes()

    class Failing(type(tmp_path)):
        def read_bytes(self):
            raise OSError(5, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(snapshot, "Path", Failing)
        with caplog.at_level(logging.WARNING):
            p = make_proposer(smollm2_dir, snapshot_path=str(tmp_path / "learned.bin"))
    assert p.drafter.index.corpus_sequences() == []
    assert any("Input/output error" in r.getMessage() and "no snapshot is written" in r.getMessage()
               for r in caplog.records)
    p.close()
    assert (tmp_path / "learned.bin").read_bytes() == written and not (tmp_path / "learned.bin.refused").exists()

    folder = tmp_path / "folder"
    (folder / "inside").mkdir(parents=True)
    p = make_proposer(smollm2_dir, snapshot_path=str(folder))
    p.close()
    assert (folder / "inside").is_dir() and not (tmp_path / "folder.refused").exists()

    fifo = tmp_path / "fifo"  # read, it would block the engine's start for good
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING):
        p = make_proposer(smollm2_dir, snapshot_path=str(fifo))
    assert any("not a regular file" in r.getMessage() for r in caplog.records)
    p.close()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)

    from lookahead_vllm.vllm.persistence import Persistence

    identity, calls = Persistence.identity, []

    def tokenizer_late(self):  # unavailable at start, back by shutdown
        calls.append(1)
        if len(calls) == 1:
            raise OSError("tokenizer files unavailable")
        return identity(self)

    with monkeypatch.context() as m:
        m.setattr(Persistence, "identity", tokenizer_late)
        p = make_proposer(smollm2_dir, snapshot_path=str(tmp_path / "learned.bin"))
        p.warm_start([[9, 9, 9, 9]])
        p.close()
    assert (tmp_path / "learned.bin").read_bytes() == written


def test_a_snapshot_with_a_malformed_header_is_refused_and_kept_aside(tmp_path, smollm2_dir):
    """A header with a valid checksum but no identity (another tool's file) is refused on its
    content like any corrupt file: moved aside, not left to block every later write."""
    import json
    import struct
    import zlib

    from lookahead_vllm.core import snapshot

    header = json.dumps({"num_sequences": 0, "num_tokens": 0, "trie_nodes": 0}).encode()
    body = snapshot._PREFIX.pack(snapshot.MAGIC, max(snapshot.READ_VERSIONS), len(header)) + header
    path = tmp_path / "learned.bin"
    path.write_bytes(body + struct.pack("<I", zlib.crc32(body)))
    with pytest.raises(snapshot.SnapshotError, match="unreadable header"):
        snapshot.decode(path.read_bytes())
    p = make_proposer(smollm2_dir, snapshot_path=str(path))
    p.warm_start([[5, 6, 7, 8]])
    p.close()
    assert (tmp_path / "learned.bin.refused").read_bytes() == body + struct.pack("<I", zlib.crc32(body))
    assert make_proposer(smollm2_dir, snapshot_path=str(path)).drafter.index.corpus_sequences() == [[5, 6, 7, 8]]


def test_data_parallel_engines_keep_snapshots_of_their_own(tmp_path, smollm2_dir, caplog):
    """Data-parallel engines learn apart, so each keeps its own file (rank r: ``<path>.dp<r>``)
    instead of the last one to shut down overwriting the others'; an engine without a file of its
    own starts from rank 0's, which it reads and never moves or writes."""
    snap = tmp_path / "learned.bin"
    rank0 = make_proposer(smollm2_dir, snapshot_path=str(snap))
    rank0.warm_start([[5, 6, 7, 8]])
    rank0.close()
    written = snap.read_bytes()
    rank1 = make_proposer(smollm2_dir, dp_rank=1, snapshot_path=str(snap))
    assert rank1.drafter.index.corpus_sequences() == [[5, 6, 7, 8]]  # started from rank 0's
    rank1.warm_start([[9, 10, 11, 12]])
    rank1.close()
    assert snap.read_bytes() == written and (tmp_path / "learned.bin.dp1").is_file()
    assert make_proposer(smollm2_dir, snapshot_path=str(snap)).drafter.index.corpus_sequences() == [[5, 6, 7, 8]]
    again = make_proposer(smollm2_dir, dp_rank=1, snapshot_path=str(snap))
    assert sorted(again.drafter.index.corpus_sequences()) == [[5, 6, 7, 8], [9, 10, 11, 12]]

    snap.write_bytes(b"not a snapshot")  # rank 0's file refused: rank 2 starts cold and leaves it be
    with caplog.at_level(logging.WARNING):
        rank2 = make_proposer(smollm2_dir, dp_rank=2, snapshot_path=str(snap))
    assert rank2.drafter.index.corpus_sequences() == []
    assert any(f"{snap}: not loaded" in r.getMessage() and "starts cold" in r.getMessage() for r in caplog.records)
    rank2.warm_start([[1, 2, 3]])
    rank2.close()
    assert snap.read_bytes() == b"not a snapshot" and not (tmp_path / "learned.bin.refused").exists()
    rank2 = make_proposer(smollm2_dir, dp_rank=2, snapshot_path=str(snap))
    assert rank2.drafter.index.corpus_sequences() == [[1, 2, 3]]


def test_a_data_parallel_engine_whose_own_snapshot_is_refused_starts_from_rank_0s(tmp_path, smollm2_dir):
    """Rank r's own file refused: set aside as ``<path>.dp<r>.refused``, and the engine starts
    from rank 0's file, as a tensor-parallel rank of it that finds the file already moved aside
    does (else the ranks' drafters would differ)."""
    import vllm.config

    assert "data_parallel_index" in vllm.config.ParallelConfig.__dataclass_fields__  # where the rank is read
    snap = tmp_path / "learned.bin"
    rank0 = make_proposer(smollm2_dir, snapshot_path=str(snap))
    rank0.warm_start([[5, 6, 7, 8]])
    rank0.close()
    (tmp_path / "learned.bin.dp1").write_bytes(b"not a snapshot")
    first = make_proposer(smollm2_dir, dp_rank=1, snapshot_path=str(snap))
    assert first.drafter.index.corpus_sequences() == [[5, 6, 7, 8]]
    assert (tmp_path / "learned.bin.dp1.refused").read_bytes() == b"not a snapshot"
    assert not (tmp_path / "learned.bin.dp1").exists()
    second = make_proposer(smollm2_dir, dp_rank=1, snapshot_path=str(snap))  # the file already moved aside
    assert second.drafter.index.corpus_sequences() == first.drafter.index.corpus_sequences()


def test_tree_mode_ranks_that_learned_differently_all_start_cold(tmp_path, smollm2_dir, monkeypatch, caplog):
    """In tree mode each tensor-parallel rank verifies the trees its own drafter planned: where
    the ranks' drafters differ after start (a file one rank could not read), every rank starts
    cold and writes no snapshot; chains (drafted on the ranks alike, verified as vLLM sends
    them) keep what they loaded."""
    from lookahead_vllm.vllm import proposer as proposer_module

    snap = tmp_path / "learned.bin"
    writer = make_proposer(smollm2_dir, snapshot_path=str(snap))
    writer.warm_start([[5, 6, 7, 8]])
    writer.close()
    one = make_proposer(smollm2_dir, draft_shape="hier", snapshot_path=str(snap))
    assert one.drafter.index.corpus_sequences() == [[5, 6, 7, 8]]  # one rank: nothing to agree on
    one.close()
    written = snap.read_bytes()
    seen = []
    monkeypatch.setattr(proposer_module, "_differs_across_ranks", lambda value: seen.append(value) or True)
    with caplog.at_level(logging.WARNING):
        tree = make_proposer(smollm2_dir, draft_shape="hier", snapshot_path=str(snap))
    assert seen and tree.drafter.index.corpus_sequences() == []
    (kind, record), = seen[0][0]  # what the rank loaded is compared, not only sizes
    assert kind == "snapshot" and record[:3] == (str(snap), 1, 4) and record[3] > 0  # file, outputs, tokens, written
    assert any("every rank starts cold" in r.getMessage() for r in caplog.records)
    tree.warm_start([[1, 2, 3]])
    tree.close()
    assert snap.read_bytes() == written
    chain = make_proposer(smollm2_dir, snapshot_path=str(snap))
    assert chain.drafter.index.corpus_sequences() == [[5, 6, 7, 8]] and len(seen) == 1


@pytest.mark.parametrize("failure", ["unreadable", "refused"])
def test_a_rank_that_finds_its_engines_file_moved_aside_starts_from_rank_0s(tmp_path, smollm2_dir, monkeypatch,
                                                                           failure):
    """Data-parallel rank 1's own file, refused by another tensor-parallel rank of its engine
    while this one reads it (gone when read, or gone when this one moves it aside): this rank
    too starts from rank 0's file, as the refusing rank does."""
    from lookahead_vllm.core import drafter as drafter_module
    from lookahead_vllm.core.snapshot import SnapshotError, SnapshotUnreadable

    snap = tmp_path / "learned.bin"
    rank0 = make_proposer(smollm2_dir, snapshot_path=str(snap))
    rank0.warm_start([[5, 6, 7, 8]])
    rank0.close()
    own = tmp_path / "learned.bin.dp1"
    own.write_bytes(b"not a snapshot")
    load = drafter_module.Drafter.load_snapshot

    def raced(self, path, identity):
        if path == str(own):
            own.unlink()  # the other rank moved it aside
            if failure == "unreadable":
                raise SnapshotUnreadable(f"snapshot {path}: No such file or directory")
            raise SnapshotError(f"snapshot {path}: bad magic")
        return load(self, path, identity)

    monkeypatch.setattr(drafter_module.Drafter, "load_snapshot", raced)
    rank1 = make_proposer(smollm2_dir, dp_rank=1, snapshot_path=str(snap))
    assert rank1.drafter.index.corpus_sequences() == [[5, 6, 7, 8]]
    assert rank1._persistence.learned["snapshot"][0] == str(snap)


def test_ranks_compare_rank_0s_value_and_every_verdict(monkeypatch):
    """``_differs_across_ranks`` over a stand-in tensor-parallel group of two: rank 0's value is
    broadcast, and any rank's verdict makes every rank's answer True."""
    import torch.distributed
    import vllm.distributed

    from lookahead_vllm.vllm.proposer import _differs_across_ranks

    assert _differs_across_ranks(("anything",)) is False  # no distributed state: one rank
    rank0_value, peer_verdict = ["a"], [0]

    class Group:
        cpu_group = "cpu"

        def broadcast_object(self, value, src):
            assert src == 0
            return rank0_value[0]

    def all_reduce(tensor, group):
        assert group == "cpu"
        tensor += peer_verdict[0]

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: Group())
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    assert _differs_across_ranks("a") is False
    assert _differs_across_ranks("b") is True  # this rank differs from rank 0
    peer_verdict[0] = 1
    assert _differs_across_ranks("a") is True  # another rank differs



class RegisteredTokenizer:
    """A tokenizer mode registered with vLLM (as a plugin would): numbers each text's characters."""

    is_fast = True

    @classmethod
    def from_pretrained(cls, name, *args, **kwargs):
        return cls()

    def __len__(self) -> int:
        return 256

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(ch) % 256 for ch in text] for text in texts]}


@pytest.mark.parametrize("mode", ["auto", "lookahead-test-chars"])
def test_warm_start_tokenizes_as_the_engine_does(smollm2_dir, mode):
    """The warm-start file and the snapshot identity use the model's tokenizer as vLLM loads it for
    the engine's ``tokenizer_mode`` (a mode registered with vLLM's TokenizerRegistry included), not
    AutoTokenizer's, which ignores the mode."""
    from transformers import AutoTokenizer
    from vllm.tokenizers import TokenizerRegistry

    from lookahead_vllm.core.config import resolve
    from lookahead_vllm.vllm.persistence import Persistence

    TokenizerRegistry.register("lookahead-test-chars", __name__, "RegisteredTokenizer")
    model_config = SimpleNamespace(model=smollm2_dir, tokenizer=smollm2_dir, tokenizer_mode=mode,
                                   tokenizer_revision=None, trust_remote_code=False)
    persistence = Persistence(resolve(), model_config)
    ids = persistence.tokenizer()(TEXTS, add_special_tokens=False)["input_ids"]
    if mode == "auto":
        assert ids == AutoTokenizer.from_pretrained(smollm2_dir)(TEXTS, add_special_tokens=False)["input_ids"]
    else:
        assert ids == [[ord(ch) % 256 for ch in text] for text in TEXTS]
        assert persistence.identity()["vocab_size"] == 256
