"""Snapshots and warm starts against other processes: a warm_start file replaced while the
engine starts is named in the snapshot by the bytes learned; one engine writes a snapshot file
(its lock), a second server given the same path reads it and writes it only once the first
has shut down, the other
tensor-parallel ranks of an engine never lock or write, and a crashed holder blocks no one."""

from __future__ import annotations

import builtins
import fcntl
import hashlib
import io
import json
import logging
import os
import subprocess
import sys

import pytest

from lookahead_vllm.core.snapshot import decode
from tests.vllm.test_warm_start import TEXTS, make_proposer

pytestmark = pytest.mark.vllm

HOLDER = "another engine holds it"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _corpus(proposer) -> list[list[int]]:
    return proposer.drafter.index.corpus_sequences()


def _seeded(smollm2_dir, snap, outputs) -> None:
    """A snapshot at ``snap`` holding ``outputs`` (written by an engine now shut down)."""
    p = make_proposer(smollm2_dir, snapshot_path=str(snap))
    p.warm_start(outputs)
    p.close()


def _holder_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if HOLDER in r.getMessage()]


def test_flock_conflicts_between_two_opens_in_one_process(tmp_path):
    """What the tests below rest on: flock locks an open file description, so two opens of
    one file in one process conflict as two processes do."""
    a, b = (os.open(tmp_path / "x.lock", os.O_RDWR | os.O_CREAT) for _ in range(2))
    try:
        fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(a)
    fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(b)


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_a_warm_start_file_is_streamed_as_text_mode_reads_it(tmp_path, monkeypatch, chunk):
    """``WarmReader``: the texts come as a file opened in text mode reads them (newlines, undecodable
    bytes replaced), in chunks of any size (a CR-LF split between two), and the digest is of the
    bytes they came from; ``file_digest`` agrees; a FIFO is refused by both, not waited on."""
    from lookahead_vllm.core import warm_start

    monkeypatch.setattr(warm_start, "CHUNK_BYTES", chunk)
    path = tmp_path / "past.txt"
    path.write_bytes(b"one\r\ntwo\r\n\r\nthree\rfour\xff\n \t\n\nfive")
    warm = warm_start.WarmReader(path)
    assert warm.digest == ""  # not before the texts were read
    assert list(warm.texts()) == ["one\ntwo", "three\nfour\ufffd", "five"]
    assert warm.digest == hashlib.sha256(path.read_bytes()).hexdigest() == warm_start.file_digest(path)
    assert warm.bytes_read == warm.size == path.stat().st_size
    big = tmp_path / "big.jsonl"  # 8 MB: read as the texts are taken, not whole
    big.write_text("".join(json.dumps({"text": f"{i} " + "x" * 1000}) + "\n" for i in range(8000)))
    streamed = warm_start.WarmReader(big)
    texts = streamed.texts()
    assert next(texts).startswith("0 ") and streamed.bytes_read <= 2 * max(chunk, 8192) < streamed.size
    assert sum(1 for _ in texts) == 7999 and streamed.bytes_read == streamed.size
    os.mkfifo(tmp_path / "fifo")
    for read in (warm_start.WarmReader, warm_start.file_digest):
        with pytest.raises(OSError, match="not a regular file"):
            read(tmp_path / "fifo")


def test_the_snapshot_names_the_warm_start_bytes_it_learned(tmp_path, smollm2_dir, tokenizer, monkeypatch):
    """The warm_start file is replaced (atomically, as a deploy does) right after the engine
    first opens it: the digest the snapshot names is that of the bytes learned, so the next
    start learns the new file once (not skipped as held, not learned twice)."""
    past, snap = tmp_path / "past.txt", tmp_path / "learned.bin"
    old, new = "\n\n".join(TEXTS[:2]), TEXTS[2]
    past.write_text(old)
    replaced = []

    def replace_after_first_open(opened, path):
        if isinstance(path, (str, os.PathLike)) and os.fspath(path) == str(past) and not replaced:
            replaced.append(path)
            (tmp_path / "past.new").write_text(new)
            os.replace(tmp_path / "past.new", past)
        return opened

    for module, name in ((os, "open"), (builtins, "open"), (io, "open")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda path, *a, real=real, **k: replace_after_first_open(
            real(path, *a, **k), path))
    first = make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap))
    first.close()
    monkeypatch.undo()
    assert replaced and past.read_text() == new
    tokens = {hashlib.sha256(text.encode()).hexdigest(): [tokenizer(t, add_special_tokens=False)["input_ids"]
                                                         for t in text.split("\n\n")] for text in (old, new)}
    named = decode(snap.read_bytes()).info["warm_start"]
    assert named in tokens and _corpus(first) == tokens[named]  # named by the bytes it learned
    again = make_proposer(smollm2_dir, warm_start=str(past), snapshot_path=str(snap))
    new_digest = hashlib.sha256(new.encode()).hexdigest()
    # The new file once: learned now, or (the first engine learned it) held and not learned again.
    assert _corpus(again) == tokens[named] + ([] if named == new_digest else tokens[new_digest])
    again.close()


def test_a_second_engine_on_the_same_snapshot_writes_only_after_the_holder(tmp_path, smollm2_dir, caplog):
    """Two engines given one snapshot_path (two servers, or a notebook that builds a second
    LLM before the first is gone): the first to start holds the file; the second starts from
    it read only, warns once, and writes nothing while the first holds it (before the lock the
    last to write won whenever it wrote); once the first has shut down, the second's poll takes
    the lock before an engine started later can, and it writes at its shutdown (it started from
    the file: what it learned is kept, the first one's last save replaced); after its shutdown
    a save takes nothing."""
    snap = tmp_path / "learned.bin"
    _seeded(smollm2_dir, snap, [[1, 2, 3, 4]])
    seeded = snap.read_bytes()
    first = make_proposer(smollm2_dir, snapshot_path=str(snap))
    with caplog.at_level(logging.WARNING):
        second = make_proposer(smollm2_dir, snapshot_path=str(snap))
    assert _corpus(second) == [[1, 2, 3, 4]]  # started from the file
    first.warm_start([[5, 6, 7, 8]])
    second.warm_start([[9, 9, 9, 9]])
    second.save_snapshot()
    assert snap.read_bytes() == seeded  # the first one holds the file: the second wrote nothing
    first.close()
    assert _saved(snap) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    warnings = _holder_warnings(caplog)
    assert len(warnings) == 1 and str(snap) in warnings[0] and "tries the lock every 30 s" in warnings[0]
    assert "its own snapshot_path" in warnings[0] and f"pid {os.getpid()} " in warnings[0]
    keeper = second._persistence
    assert keeper.waiting and not keeper.owner
    keeper._next_retake = 0.0  # as after RETAKE_EVERY_S: the step's poll takes the freed lock
    keeper.poll()
    assert keeper.owner and not keeper.waiting
    with caplog.at_level(logging.WARNING):
        later = make_proposer(smollm2_dir, snapshot_path=str(snap))  # started after: read only now
    assert len(_holder_warnings(caplog)) == 2
    later.close()
    assert _saved(snap) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    second.close()  # it holds the file: it writes what it holds (the first one's last save is replaced)
    assert not (tmp_path / "learned.bin.lock").exists()  # removed when the second released it
    assert _saved(snap) == [[1, 2, 3, 4], [9, 9, 9, 9]]
    written = snap.read_bytes()
    second.save_snapshot()  # after shutdown: no lock taken again, nothing written
    later.save_snapshot()  # shut down while another held the file: nor does it take the freed lock
    assert snap.read_bytes() == written and not (tmp_path / "learned.bin.lock").exists()


def _saved(snap) -> list[list[int]]:
    """The outputs the snapshot file holds, sorted."""
    return sorted(map(list, decode(snap.read_bytes()).sequences))


def test_an_engine_that_cannot_open_the_lock_file_writes_nothing(tmp_path, smollm2_dir, monkeypatch):
    """A lock file this process cannot open at all (another user's, unreadable) leaves the
    engine read only: it starts from the file and never writes over it."""
    from lookahead_vllm.core.snapshot import SnapshotLock

    snap = tmp_path / "learned.bin"
    _seeded(smollm2_dir, snap, [[1, 2, 3, 4]])
    seeded = snap.read_bytes()

    def denied(self):
        raise PermissionError(13, "Permission denied", self.path)

    monkeypatch.setattr(SnapshotLock, "acquire", denied)
    engine = make_proposer(smollm2_dir, snapshot_path=str(snap))
    assert _corpus(engine) == [[1, 2, 3, 4]] and not engine._persistence.owner
    engine.warm_start([[9, 9, 9, 9]])
    engine.close()
    assert snap.read_bytes() == seeded


def test_a_lock_file_of_another_user_is_locked_read_only(tmp_path, monkeypatch):
    """A lock file this process may not open for writing (another user's, mode 0644) is
    opened read only: flock still excludes the other engine, instead of writing unguarded."""
    from lookahead_vllm.core.snapshot import SnapshotLock

    snap = tmp_path / "learned.bin"
    holder = SnapshotLock(snap)
    assert holder.acquire()
    real_open = os.open

    def no_write(path, flags, *args):
        if os.fspath(path).endswith(".lock") and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_write)
    other = SnapshotLock(snap)
    assert other.acquire() is False and other.holder.startswith(f"pid {os.getpid()} ")
    holder.release()
    (tmp_path / "learned.bin.lock").write_text("")  # the other user's file stays at the path
    assert other.acquire() is True
    other.release()


def test_a_lock_file_that_may_not_be_created_is_a_permission_error(tmp_path, monkeypatch):
    """Where no lock file exists and this process may not create one (a folder it cannot
    write), acquiring says so (PermissionError: the engine starts read only) rather than
    "no such file" (taken for a file system that cannot lock: written unguarded, and the
    write at shutdown fails)."""
    from lookahead_vllm.core.snapshot import SnapshotLock

    real_open = os.open

    def no_create(path, flags, *args):
        if os.fspath(path).endswith(".lock") and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_create)
    with pytest.raises(PermissionError):
        SnapshotLock(tmp_path / "learned.bin").acquire()


_FORKING_HOLDER = """
import os, sys
from lookahead_vllm.core.snapshot import SnapshotLock
lock = SnapshotLock(sys.argv[1])
assert lock.acquire()
pid = os.fork()
if pid == 0:  # the child: alive until the test closes its stdin
    os.write(1, f"{lock.held}\\n".encode())  # one write each: the two lines share the pipe
    sys.stdin.read()
    os._exit(0)
os.write(1, f"{pid}\\n".encode())
os._exit(0)  # the holder ends without releasing (as a killed engine)
"""


def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path):
    """A process forked by the holder (a compile worker, a subprocess pool) closes its copy of
    the lock's descriptor at once: when the holder is gone the lock is free, though the child
    lives on (else the next engine would find it held by a dead process's child)."""
    from lookahead_vllm.core.snapshot import SnapshotLock

    snap = tmp_path / "learned.bin"
    with subprocess.Popen([sys.executable, "-c", _FORKING_HOLDER, str(snap)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as run:
        lines = [run.stdout.readline().strip() for _ in range(2)]
        run.wait(timeout=60)
        child = int(next(line for line in lines if line.isdigit()))
        assert "False" in lines  # the child holds no lock
        os.kill(child, 0)  # still alive
        lock = SnapshotLock(snap)
        assert lock.acquire() is True
        lock.release()
        run.stdin.close()  # the child ends


def test_a_fork_waits_for_an_acquire_under_way(tmp_path, monkeypatch):
    """A thread forking while another takes the lock waits until the lock is taken (and so
    listed for the child to let go of): forked between the open and that, the child would keep
    the lock's file description."""
    import threading

    from lookahead_vllm.core.snapshot import SnapshotLock

    inside, go = threading.Event(), threading.Event()
    real_open = os.open
    opened = []

    def slow_open(path, *args):
        fd = real_open(path, *args)
        if os.fspath(path).endswith(".lock"):
            opened.append(fd)
            inside.set()
            go.wait(10)
        return fd

    monkeypatch.setattr(os, "open", slow_open)
    lock = SnapshotLock(tmp_path / "learned.bin")
    taker = threading.Thread(target=lock.acquire)
    taker.start()
    assert inside.wait(10)
    forked = {}

    def fork():
        pid = os.fork()
        if pid == 0:  # the lock's file description must not be open here
            try:
                os.fstat(opened[0])
            except OSError:
                os._exit(0 if not lock.held else 3)
            os._exit(4)
        forked["pid"] = pid

    forker = threading.Thread(target=fork)
    forker.start()
    forker.join(0.5)
    waited = forker.is_alive()
    go.set()
    taker.join(10)
    forker.join(10)
    _, status = os.waitpid(forked["pid"], 0)
    assert waited and os.waitstatus_to_exitcode(status) == 0
    assert lock.held
    lock.release()


def test_a_forked_child_neither_writes_the_snapshot_nor_releases_the_lock(tmp_path, smollm2_dir):
    """A child forked from a process whose engine holds the snapshot file inherits its atexit
    handler, which closes the engine: there it writes nothing and leaves the lock (and the
    lock file) to the parent, which still writes at its own shutdown."""
    from lookahead_vllm.core.snapshot import SnapshotLock

    snap = tmp_path / "learned.bin"
    proposer = make_proposer(smollm2_dir, snapshot_path=str(snap))
    proposer.warm_start([[5, 6, 7, 8]])
    pid = os.fork()
    if pid == 0:  # the child: what its inherited atexit handler does
        try:
            proposer.close()
            os._exit(0 if not snap.exists() and (tmp_path / "learned.bin.lock").exists() else 3)
        finally:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert SnapshotLock(snap).acquire() is False  # still the parent's
    proposer.close()
    assert _corpus_of_file(snap) == [[5, 6, 7, 8]]


def _corpus_of_file(snap) -> list[list[int]]:
    return [list(map(int, s)) for s in decode(snap.read_bytes()).sequences]


def test_a_second_engine_leaves_a_held_file_it_refuses_in_place(tmp_path, smollm2_dir, tiny_llama_dir):
    """A server of another model given a path another engine holds refuses the file and
    starts cold, but never moves it aside (the file is the holder's) nor writes it, even
    after the holder has shut down."""
    snap = tmp_path / "learned.bin"
    first = make_proposer(smollm2_dir, snapshot_path=str(snap))
    first.warm_start([[5, 6, 7, 8]])
    first.save_snapshot()
    other = make_proposer(tiny_llama_dir, snapshot_path=str(snap))
    assert _corpus(other) == []
    first.close()
    other.save_snapshot()  # the holder has shut down, but the file it refused is not its to lock
    assert not other._persistence.owner
    other.close()  # nor to write over
    assert snap.is_file() and not (tmp_path / "learned.bin.refused").exists()
    assert _corpus(make_proposer(smollm2_dir, snapshot_path=str(snap))) == [[5, 6, 7, 8]]


def test_the_other_tensor_parallel_ranks_of_an_engine_never_lock_or_write(tmp_path, smollm2_dir, monkeypatch,
                                                                          caplog):
    """Ranks other than the engine's first load its file read only, with no warning (the lock
    they would find is their own engine's), take no lock and write nothing; a file they refuse
    stays in place for the first rank to move aside."""
    from lookahead_vllm.vllm import persistence

    snap = tmp_path / "learned.bin"
    _seeded(smollm2_dir, snap, [[1, 2, 3, 4]])
    rank0 = make_proposer(smollm2_dir, snapshot_path=str(snap))
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
        m.setattr(persistence, "_first_drafting_rank", lambda: False)
        rank1 = make_proposer(smollm2_dir, snapshot_path=str(snap))
    assert _corpus(rank1) == _corpus(rank0) == [[1, 2, 3, 4]] and not _holder_warnings(caplog)
    rank0.close()
    written = snap.read_bytes()
    rank1.warm_start([[9, 9, 9, 9]])
    rank1.close()
    assert snap.read_bytes() == written

    snap.write_bytes(b"not a snapshot")
    with monkeypatch.context() as m:
        m.setattr(persistence, "_first_drafting_rank", lambda: False)
        rank1 = make_proposer(smollm2_dir, snapshot_path=str(snap))
        assert not (tmp_path / "learned.bin.lock").exists()  # no lock taken
        assert _corpus(rank1) == [] and snap.read_bytes() == b"not a snapshot"
    rank0 = make_proposer(smollm2_dir, snapshot_path=str(snap))  # not locked out by rank 1
    assert _corpus(rank0) == [] and (tmp_path / "learned.bin.refused").read_bytes() == b"not a snapshot"
    rank1.close()
    rank0.close()


def test_the_first_drafting_rank_is_tensor_and_prefill_context_parallel_rank_0(monkeypatch):
    from vllm.distributed import parallel_state

    from lookahead_vllm.vllm.persistence import _first_drafting_rank

    assert _first_drafting_rank()  # no distributed state: one rank
    ranks = {"get_tp_group": 0, "get_pcp_group": 0}
    for name in ranks:
        monkeypatch.setattr(parallel_state, name, lambda name=name: type("Group", (), {
            "rank_in_group": ranks[name]})())
    assert _first_drafting_rank()
    ranks["get_tp_group"] = 1
    assert not _first_drafting_rank()
    ranks.update(get_tp_group=0, get_pcp_group=2)
    assert not _first_drafting_rank()


def test_data_parallel_ranks_alive_together_each_hold_their_own_file(tmp_path, smollm2_dir, caplog):
    snap = tmp_path / "learned.bin"
    with caplog.at_level(logging.WARNING):
        ranks = [make_proposer(smollm2_dir, dp_rank=r, snapshot_path=str(snap)) for r in range(3)]
    assert not _holder_warnings(caplog)
    for r, p in enumerate(ranks):
        p.warm_start([[r + 1] * 4])
        p.close()
    for r in range(3):
        assert _corpus(make_proposer(smollm2_dir, dp_rank=r, snapshot_path=str(snap)))[-1] == [r + 1] * 4


def test_a_crashed_holder_blocks_no_one(tmp_path, smollm2_dir, caplog):
    """Another process holds the file (its lock): this engine writes nothing; the process is
    killed (no shutdown, its lock file left behind): the next engine holds the file."""
    snap = tmp_path / "learned.bin"
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); os.write(fd, b'pid %d on elsewhere' % os.getpid()); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, f"{snap}.lock"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING):
            blocked = make_proposer(smollm2_dir, snapshot_path=str(snap))
        assert any(f"pid {holder.pid} on elsewhere" in w for w in _holder_warnings(caplog))
        blocked.warm_start([[9, 9, 9, 9]])
        blocked.close()
        assert not snap.exists()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "learned.bin.lock").exists()
    after = make_proposer(smollm2_dir, snapshot_path=str(snap))
    after.warm_start([[5, 6, 7, 8]])
    after.close()
    assert _corpus(make_proposer(smollm2_dir, snapshot_path=str(snap))) == [[5, 6, 7, 8]]
