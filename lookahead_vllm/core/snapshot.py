"""Drafter snapshots: what the engine learned, written on shutdown and read back on start (``snapshot_path``): the
draft index's finished outputs, oldest first (added and finished in that order into an empty index, they rebuild its
corpus exactly, under any settings), each with its partition's label (core/partitions.py; salted ones only where the
policy saves them), and the trie's output counts as a pre-order node table (prompt counts belong to running requests
and are not stored). Token ids mean what the snapshot's identity (tokenizer name, vocabulary size) says; a snapshot
of another identity is refused. Of the header's ``settings`` only ``branch_length`` (the trie table's depth) is
checked, where there is a trie table. A crash leaves the old snapshot or the new one, never a part. One writer a
file: :class:`SnapshotLock`.

File layout (little-endian)::

    magic     8 bytes  b"LKAHSNAP"
    version   uint32   FORMAT_VERSION
    header    uint32 length + JSON: identity, settings, info, counts, "partitions": the salted labels held
    lengths   int32[num_sequences]
    labels    int32[num_sequences]: 0 = "", i = partitions[i - 1]  (version 2; version 1: all "")
    tokens    int32[sum(lengths)]
    trie      int32[n] parents, int32[n] tokens, float64[n] counts
    crc32     uint32 of every byte before it
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import socket
import struct
import tempfile
import threading
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

MAGIC = b"LKAHSNAP"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # 1: before partitions, every output in the default one
# Config fields written to the header (those that shape drafts).
DRAFT_SETTINGS = ("source", "branch_length", "index_ngram", "index_backoff",
                  "index_max_match", "index_candidates", "index_occurrences", "index_corpus_bytes")
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_DTYPES = ("<i4", "<i4", "<i4", "<i4", "<i4", "<f8")  # lengths, labels, tokens, trie parents, tokens, counts


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message says why."""


class SnapshotUnreadable(SnapshotError):
    """A snapshot file the system would not read (permissions, I/O): its content was never judged."""


@dataclass(frozen=True, slots=True)
class TrieTable:
    parents: np.ndarray  # [n] int32, each < its own row
    tokens: np.ndarray  # [n] int32
    counts: np.ndarray  # [n] float64


@dataclass(frozen=True, slots=True)
class Snapshot:
    identity: dict[str, Any]  # model name and vocabulary size the token ids belong to
    settings: dict[str, Any]  # DRAFT_SETTINGS of the engine that wrote it
    info: dict[str, Any]  # free-form facts (e.g. the warm_start file's digest)
    sequences: list[list[int]]  # finished outputs, oldest first
    trie: TrieTable | None  # the trie's output counts (None: no trie source)
    labels: list[str]  # each output's partition label

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.sequences):
            raise ValueError(f"labels: {len(self.labels)} for {len(self.sequences)} sequences")

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.sequences))


def identity_of(model: str, vocab_size: int) -> dict[str, Any]:
    """The identity of token ids: the model's folder or hub name (not its full path, so a moved
    checkout still matches) and the vocabulary size."""
    return {"model": Path(str(model).rstrip("/")).name, "vocab_size": int(vocab_size)}


def settings_of(config: Any) -> dict[str, Any]:
    """The DRAFT_SETTINGS of ``config`` (a ``core.config.Settings``: public fields, then its profile's)."""
    return {name: getattr(config if hasattr(config, name) else config.profile, name) for name in DRAFT_SETTINGS}


class SnapshotLock:
    """The advisory lock of the one process that writes the snapshot at ``path``: ``flock(LOCK_EX | LOCK_NB)`` on
    ``<path>.lock``, whose text names the holder (``pid <pid> on <host>``); two opens in one process conflict too, and
    the kernel releases a dead process's lock. ``release`` removes the file, so ``acquire`` checks that the file it
    locked is still the one at the path. A forked child closes its copy at once (lest a compile worker keep it)."""

    _held: "weakref.WeakSet[SnapshotLock]" = weakref.WeakSet()  # held in this process: a forked child lets go

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = f"{path}.lock"
        self._fd: int | None = None  # the locked file while held
        self.holder = ""  # who held it when acquire found it taken ("" unknown)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock without waiting: True when taken (held until ``release``),
        False when another holds it (``holder``); OSError when it cannot be tried."""
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        denied: PermissionError | None = None
        with _FORK_GUARD[0]:
            for _ in range(16):  # each retry: the file was removed by a holder releasing it meanwhile
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                except PermissionError as exc:  # another user's lock file: flock works on a read-only open too
                    try:
                        fd = os.open(self.path, os.O_RDONLY)
                    except FileNotFoundError:  # none there (a holder removed it, or none may be made here)
                        denied = exc
                        continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    with contextlib.suppress(OSError):
                        self.holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    os.close(fd)
                    return False
                except BaseException:
                    os.close(fd)
                    raise
                if self._is_at_path(fd):
                    with contextlib.suppress(OSError):  # the holder's name only informs
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
                    self._fd = fd
                    SnapshotLock._held.add(self)
                    return True
                os.close(fd)
        if denied is not None:  # this process may not make the lock file (the folder's mode)
            raise denied
        raise OSError(errno.EAGAIN, "the lock file kept being replaced", self.path)

    def release(self) -> None:
        """Remove the lock file (while still holding it) and unlock; no-op when not held."""
        with _FORK_GUARD[0]:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            SnapshotLock._held.discard(self)
            with contextlib.suppress(OSError):
                if self._is_at_path(fd):
                    os.unlink(self.path)
            os.close(fd)

    def _is_at_path(self, fd: int) -> bool:
        try:
            at, held = os.stat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)


# Held by acquire, release and around os.fork (no fork between the open and ``_held``); in a list: a child makes a
# new one (its copy is held by the forking thread); reentrant: a GC can close an old engine inside an acquire.
_FORK_GUARD = [threading.RLock()]
_FORK_TOOK = [False]  # whether the fork under way took the guard (a signal can interrupt the wait)


def _before_fork() -> None:
    _FORK_TOOK[0] = False
    _FORK_TOOK[0] = _FORK_GUARD[0].acquire()


def _after_fork_in_parent() -> None:
    took, _FORK_TOOK[0] = _FORK_TOOK[0], False
    if took:
        _FORK_GUARD[0].release()


def _after_fork_in_child() -> None:
    """Close this process's copies of the held locks' descriptors (the lock stays the parent's)."""
    _FORK_GUARD[0], _FORK_TOOK[0] = threading.RLock(), False
    for lock in list(SnapshotLock._held):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    SnapshotLock._held = weakref.WeakSet()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def encode(snap: Snapshot) -> bytes:
    lengths = np.asarray([len(s) for s in snap.sequences], "<i4")
    tokens = np.concatenate([np.asarray(s, "<i4") for s in snap.sequences]) if snap.sequences else np.zeros(0, "<i4")
    trie = snap.trie or TrieTable(np.zeros(0, "<i4"), np.zeros(0, "<i4"), np.zeros(0, "<f8"))
    salted = sorted({label for label in snap.labels if label})
    number = {label: i + 1 for i, label in enumerate(salted)}
    labels = np.asarray([number.get(label, 0) for label in snap.labels], "<i4")
    header = json.dumps({
        "identity": snap.identity, "settings": snap.settings, "info": snap.info,
        "num_sequences": len(lengths), "num_tokens": int(lengths.sum()),
        "trie_nodes": len(trie.tokens), "has_trie": snap.trie is not None, "partitions": salted,
    }, sort_keys=True).encode()
    arrays = (lengths, labels, tokens, trie.parents, trie.tokens, trie.counts)
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + b"".join(
        np.ascontiguousarray(arr, dtype).tobytes() for arr, dtype in zip(arrays, _DTYPES))
    return body + struct.pack("<I", zlib.crc32(body))


def write_snapshot(path: str | os.PathLike, snap: Snapshot) -> None:
    """Write ``snap`` atomically (a temporary file in the same folder, fsync, ``os.replace``)."""
    path = Path(path)
    data = encode(snap)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the folder's entry too; best effort: not every file system syncs a folder
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def decode(data: bytes) -> Snapshot:
    """Parse and check a snapshot's bytes; SnapshotError says what is wrong."""
    if len(data) < _PREFIX.size + 4:
        raise SnapshotError(f"truncated: {len(data)} bytes is shorter than the header")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError(f"not a lookahead snapshot (magic {magic!r}, expected {MAGIC!r})")
    if version not in READ_VERSIONS:
        raise SnapshotError(f"format version {version}, this build reads versions {READ_VERSIONS}")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(data[:-4]) != crc:
        raise SnapshotError("checksum mismatch (truncated or corrupt file)")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + hlen])
        ns, nt, nn = int(header["num_sequences"]), int(header["num_tokens"]), int(header["trie_nodes"])
        salted = [str(label) for label in header.get("partitions", [])]
        identity, settings, info = header["identity"], header.get("settings", {}), header.get("info", {})
        if not all(isinstance(part, dict) for part in (identity, settings, info)):
            raise TypeError("identity, settings and info must be objects")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"unreadable header ({exc!r})") from None
    nl = ns if version >= 2 else 0
    sizes = (ns, nl, nt, nn, nn, nn)
    starts = list(itertools.accumulate((n * np.dtype(d).itemsize for n, d in zip(sizes, _DTYPES)),
                                       initial=_PREFIX.size + hlen))
    if starts[-1] != len(data) - 4:
        raise SnapshotError("payload size does not match the header (truncated or corrupt file)")
    lengths, label_ids, tokens, parents, ttokens, counts = (
        np.frombuffer(data, dtype, n, at) for n, dtype, at in zip(sizes, _DTYPES, starts))
    if nl and ((label_ids < 0) | (label_ids > len(salted))).any():
        raise SnapshotError("an output's partition is not in the header's partitions")
    names = ["", *salted]
    labels = [names[i] for i in label_ids.tolist()] if nl else [""] * ns
    if (lengths < 0).any() or int(lengths.sum()) != nt:
        raise SnapshotError("sequence lengths do not add up to the token count")
    if nn and ((parents < -1) | (parents >= np.arange(nn))).any():
        raise SnapshotError("trie table has a parent that is not an earlier row")
    sequences = [s.tolist() for s in np.split(tokens, np.cumsum(lengths)[:-1])] if ns else []
    trie = TrieTable(parents.astype(np.int32), ttokens.astype(np.int32), counts.astype(np.float64)) \
        if header.get("has_trie") else None
    return Snapshot(identity, settings, info, sequences, trie, labels)


def read_snapshot(path: str | os.PathLike, identity: Mapping[str, Any],
                  settings: Mapping[str, Any] | None = None) -> Snapshot:
    """Read a snapshot written for ``identity`` (and, where it has a trie table, ``settings``' ``branch_length``);
    SnapshotError (naming the file and the reason) when it is unreadable, corrupt or someone else's."""
    try:
        snap = decode(Path(path).read_bytes())
        for key, want in identity.items():
            if snap.identity.get(key) != want:
                raise SnapshotError(f"written for {key}={snap.identity.get(key)!r}, this engine has {key}={want!r}")
        if snap.trie is not None and len(snap.trie.tokens) and "branch_length" in (settings or {}):
            have, want = snap.settings.get("branch_length"), settings["branch_length"]
            if have != want:
                raise SnapshotError(f"trie written with branch_length={have!r}, this engine has branch_length={want!r}")
    except OSError as exc:
        raise SnapshotUnreadable(f"snapshot {path}: cannot be read ({exc.strerror or exc})") from None
    except SnapshotError as exc:
        raise SnapshotError(f"snapshot {path}: {exc}") from None
    return snap
