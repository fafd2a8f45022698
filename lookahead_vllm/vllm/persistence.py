"""Warm start and snapshots at engine start and shutdown (the rules users see: docs/configuration.md). One writer a
snapshot file: the engine's first drafting rank holding ``SnapshotLock``; every other process only reads it, never moves
it aside. Data-parallel rank ``r`` keeps ``<path>.dp<r>``, starting from rank 0's while it has none."""

from __future__ import annotations

import atexit
import itertools
import multiprocessing.util
import os
import stat
import time
import weakref
from typing import Any

from vllm.logger import init_logger

from lookahead_vllm.core.config import Settings
from lookahead_vllm.core.snapshot import Snapshot, SnapshotError, SnapshotLock, SnapshotUnreadable, identity_of
from lookahead_vllm.core.warm_start import WarmReader, file_digest

logger = init_logger(__name__)

TOKENIZE_BATCH = 1024  # warm-start texts tokenized at a time
PROGRESS_EVERY_S = 10.0  # a big warm-start file's progress is logged this often
HELD = "another engine holds it"  # why a first rank does not write: another live engine holds the lock
RETAKE_EVERY_S = 30.0  # how often a read-only engine tries that lock again (Persistence.poll)


def _first_drafting_rank() -> bool:
    """Whether this process is its engine's first drafting rank (True without distributed state)."""
    from vllm.distributed import parallel_state

    for group in (parallel_state.get_tp_group, parallel_state.get_pcp_group):
        try:
            if group().rank_in_group:
                return False
        except AssertionError:  # the group not initialized
            pass
    return True


def _sizes(snap: Snapshot) -> tuple[int, int, int]:
    """Outputs, tokens and trie nodes of ``snap``."""
    return len(snap.sequences), snap.num_tokens, 0 if snap.trie is None else len(snap.trie.tokens)


class Persistence:
    def __init__(self, config: Settings, model_config: Any, dp_rank: int = 0) -> None:
        self.config = config
        self.model_config = model_config
        shared = config.snapshot_path
        self.path = f"{shared}.dp{dp_rank}" if shared and dp_rank else shared
        self._shared = shared if self.path != shared else ""  # the file started from while self.path is absent
        self._tokenizer: Any = None
        self._identity: dict | None = None
        self._warm_digest = ""  # sha256 of the warm-start file the snapshot holds
        self.closed = False
        self.writes = True  # False once a snapshot was left in place unloaded: writing would overwrite it
        self.owner = False  # whether this process writes the file (start() decides)
        self._lock: SnapshotLock | None = None
        self._read_only = ""  # why this engine's first rank does not write its file ("" where it does)
        self._next_retake = 0.0  # when poll() next tries the lock (``waiting``)
        # What start() learned: "snapshot" (file, outputs, tokens, written_at) and "warm_start" (texts, tokens).
        self.learned: dict[str, tuple] = {}
        self._pid = os.getpid()  # a forked child (inheriting the atexit handler) neither writes nor takes the lock

    def start(self, drafter: Any) -> None:
        """Lock the snapshot file, learn the snapshot, then the warm-start texts unless the snapshot names them."""
        self._claim()
        snap = self._load_snapshot(drafter)
        path = self.config.warm_start
        if not path:
            return
        # Named by the snapshot written at shutdown: the one loaded, unless this run learns the file whole.
        held = self._warm_digest = snap.info.get("warm_start", "") if snap is not None else ""
        try:
            if held and file_digest(path) == held:  # nothing held: no hashing pass, only the one that learns
                logger.info("lookahead warm_start %s: already in the snapshot, not learned again", path)
                return
            warm = WarmReader(path)  # a second pass: the digest named is of the bytes it learns
        except OSError as exc:  # whether the snapshot holds it cannot be told: not learned (twice) this run
            logger.warning("lookahead warm_start %s: cannot be read (%s); not learned this run", path,
                           exc.strerror or exc)
            return
        try:
            self._warm(drafter, warm)
        except Exception as exc:  # noqa: BLE001 - a warm start never stops the engine
            logger.warning("lookahead warm_start %s: not learned (%r)", path, exc)
            return
        self._warm_digest = warm.digest

    def _claim(self) -> None:
        """Decide whether this process writes the snapshot file."""
        if not self.path or not _first_drafting_rank():
            return
        lock = SnapshotLock(self.path)
        try:
            taken = lock.acquire()
        except PermissionError as exc:  # another user's lock file, unreadable to us: never written over
            self._read_only = f"its lock file {lock.path} cannot be opened or created"
            logger.warning("lookahead snapshot %s: %s (%s); this engine starts from it read only and writes nothing",
                           self.path, self._read_only, exc.strerror or exc)
            return
        except OSError as exc:  # the file system cannot lock: written unguarded
            logger.warning("lookahead snapshot %s: cannot be locked (%s); written without a lock, so another "
                           "server given the same path would go unnoticed", self.path, exc.strerror or exc)
            self.owner = True
            return
        if taken:
            self.owner, self._lock = True, lock
            return
        self._read_only = HELD
        self._next_retake = time.monotonic() + RETAKE_EVERY_S
        holder = lock.holder or "unknown"
        if holder.startswith(f"pid {os.getpid()} "):
            holder += ", an engine of this process not yet shut down"
        logger.warning("lookahead snapshot %s: another engine holds it (%s; lock %s); this engine starts from it "
                       "read only and writes nothing while that engine holds it; it tries the lock every %.0f s and, "
                       "once it holds it, writes at its own shutdown, replacing what that engine saved. Give each "
                       "server its own snapshot_path", self.path, holder, lock.path, RETAKE_EVERY_S)

    def _load_snapshot(self, drafter: Any) -> Snapshot | None:
        path = self.path
        if not path:
            return None
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            if os.path.isfile(self._shared):
                return self._load_shared(drafter)
            logger.info("lookahead snapshot %s: no file yet; drafting starts cold (written on shutdown%s)", path,
                        "" if self.owner else " by the engine that holds its lock")
            return None
        except OSError as exc:  # a passing stat failure is no sign that the file is absent
            return self._keep(path, f"cannot be inspected ({exc.strerror or exc})")
        if not stat.S_ISREG(mode):  # a directory, a FIFO, a device: nothing of ours to read or replace
            return self._keep(path, "not a regular file")
        try:
            identity = self.identity()
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops the engine
            return self._keep(path, f"the tokenizer that names its identity did not load ({exc!r})")
        start = time.perf_counter()
        try:
            snap = drafter.load_snapshot(path, identity)
        except SnapshotUnreadable as exc:  # a passing I/O failure must not lose a good file
            if not os.path.lexists(path):  # moved aside meanwhile by another rank, which refused it
                logger.warning("lookahead snapshot %s: refused by another rank", path)
                return self._load_shared(drafter)
            return self._keep(path, str(exc).removeprefix(f"snapshot {path}: "))
        except SnapshotError as exc:
            self._set_aside(path, str(exc),
                            "starts from data-parallel rank 0's file" if self._shared else "starts cold")
            return self._load_shared(drafter)  # as every rank that finds the file moved aside
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops the engine
            return self._keep(path, f"could not be loaded ({exc!r})")
        return self._learned(path, snap, start)

    def _load_shared(self, drafter: Any) -> Snapshot | None:
        """Start from data-parallel rank 0's snapshot, if this engine has one, read only (on any failure: cold)."""
        path, start = self._shared, time.perf_counter()
        if not path:
            return None
        try:
            snap = drafter.load_snapshot(path, self.identity())
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops the engine
            logger.warning("lookahead snapshot %s: not loaded (%s); drafting starts cold", path,
                           str(exc).removeprefix(f"snapshot {path}: "))
            return None
        return self._learned(path, snap, start, f" (data-parallel rank 0's; this engine's own is {self.path})")

    def _learned(self, path: str, snap: Snapshot, start: float, whose: str = "") -> Snapshot:
        """Log ``snap``, loaded from ``path`` since ``start``, book it in ``learned`` and return it."""
        logger.info("lookahead snapshot %s loaded%s: %d outputs, %d tokens, %d trie nodes (%.2f s)", path, whose,
                    *_sizes(snap), time.perf_counter() - start)
        self.learned["snapshot"] = (path, len(snap.sequences), snap.num_tokens, snap.info.get("written_at"))
        return snap

    def _keep(self, path: str, why: str) -> None:
        """A snapshot not judged (unreadable, not a file, no identity) stays; this run writes none over it."""
        self.writes = False
        logger.warning("lookahead snapshot %s: %s; drafting starts cold, and no snapshot is written there this run",
                       path, why)

    def _set_aside(self, path: str, why: str, instead: str) -> None:
        """Rename a refused snapshot to the first free ``<path>.refused[.N]`` (where it cannot be, this run writes
        none); a process that does not write the file leaves it. ``instead``: what drafting does."""
        if not self.owner:
            logger.warning("lookahead %s; refused, drafting %s (the file is left to the process that writes it)",
                           why, instead)
            self.writes = False  # not overwritten by this engine either, should it take the lock later
            return
        names = (f"{path}.refused" + (f".{n}" if n else "") for n in itertools.count())
        aside = next(name for name in names if not os.path.lexists(name))
        try:
            os.rename(path, aside)
        except FileNotFoundError:  # gone meanwhile (another rank of this engine moved it)
            logger.warning("lookahead %s; refused, drafting %s", why, instead)
        except OSError as exc:
            self.writes = False
            logger.warning("lookahead %s; refused, drafting %s, and no snapshot is written to %s this run "
                           "(the file could not be moved aside: %s)", why, instead, path, exc.strerror or exc)
        else:
            logger.warning("lookahead %s; refused and kept as %s, drafting %s", why, aside, instead)

    def _warm(self, drafter: Any, warm: WarmReader) -> None:
        """Learn the warm-start file's texts a batch at a time (raises where not every text was learned)."""
        path = self.config.warm_start
        start = last_log = time.perf_counter()
        count = tokens = 0
        texts = iter(warm.texts())
        while batch := list(itertools.islice(texts, TOKENIZE_BATCH)):
            for ids in self.tokenizer()(batch, add_special_tokens=False)["input_ids"]:
                drafter.warm(ids)
                tokens += len(ids)
            count += len(batch)
            if time.perf_counter() - last_log >= PROGRESS_EVERY_S:
                last_log = time.perf_counter()
                logger.info("lookahead warm_start %s: %d texts learned, %.1f/%.1f MiB read", path, count,
                            warm.bytes_read / 2**20, warm.size / 2**20)
        if warm.skipped_lines:
            logger.warning("lookahead warm_start %s: skipped %d line(s) without a text field (first: line %d)",
                           path, len(warm.skipped_lines), warm.skipped_lines[0])
        self.learned["warm_start"] = (count, tokens)
        logger.info("lookahead warm_start %s: learned %d texts, %d tokens (%.2f s)", path, count, tokens,
                    time.perf_counter() - start)

    def close(self, drafter: Any) -> None:
        """Write the snapshot, then release the file's lock (once; later calls do nothing). Never raises."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.config.snapshot_path:
                self.save(drafter)
        finally:  # a later save() never takes the lock again
            self.owner, self._read_only = False, "this engine was shut down"
            if self._lock is not None:
                self._lock.release()

    def save(self, drafter: Any) -> Snapshot | None:
        """Write the snapshot now, where this process writes the file (``owner``, ``writes``); never raises."""
        path = self.path
        if os.getpid() != self._pid:
            return None
        self._retake()
        if not self.owner:
            if self._read_only:  # (the other ranks of an engine never write: nothing to say)
                logger.info("lookahead snapshot %s: not written (%s)", path, self._read_only)
            return None
        if not self.writes:
            logger.warning("lookahead snapshot %s: not written (the snapshot found there at start is kept)", path)
            return None
        try:
            info = {"warm_start": self._warm_digest, "written_at": time.time()}
            snap = drafter.save_snapshot(path, self.identity(), info)
        except Exception as exc:  # noqa: BLE001 - shutdown must not fail over a snapshot
            logger.warning("lookahead snapshot %s: not written (%s)", path, exc)
            return None
        logger.info("lookahead snapshot %s written: %d outputs, %d tokens, %d trie nodes", path, *_sizes(snap))
        return snap

    @property
    def waiting(self) -> bool:
        """Whether this engine waits for the lock another engine holds, to write its file (``writes``)."""
        return self._read_only == HELD and self.writes

    def poll(self) -> None:
        """While ``waiting``, try the lock every :data:`RETAKE_EVERY_S` (called after each engine step)."""
        now = time.monotonic()
        if now >= self._next_retake:
            self._next_retake = now + RETAKE_EVERY_S
            self._retake()

    def _retake(self) -> None:
        """A waiting engine takes the lock its holder freed, to write the file at shutdown."""
        if not self.waiting or os.getpid() != self._pid:
            return
        lock = SnapshotLock(self.path)
        try:
            taken = lock.acquire()
        except OSError:
            return
        if taken:
            logger.info("lookahead snapshot %s: the engine that held it has shut down; this engine holds it now "
                        "and writes it at shutdown", self.path)
            self.owner, self._lock, self._read_only = True, lock, ""

    def _model(self) -> str:
        return getattr(self.model_config, "tokenizer", None) or self.model_config.model

    def tokenizer(self) -> Any:
        """The model's tokenizer as vLLM loads it (its ``tokenizer_mode``, revision and remote code)."""
        if self._tokenizer is None:
            from vllm.tokenizers import get_tokenizer

            mc = self.model_config
            self._tokenizer = get_tokenizer(self._model(), tokenizer_mode=getattr(mc, "tokenizer_mode", "auto"),
                                            revision=getattr(mc, "tokenizer_revision", None),
                                            trust_remote_code=bool(getattr(mc, "trust_remote_code", False)))
        return self._tokenizer

    def identity(self) -> dict:
        """The snapshot identity: tokenizer folder name and vocabulary size."""
        if self._identity is None:
            self._identity = identity_of(self._model(), len(self.tokenizer()))
        return self._identity


def close_at_exit(proposer: Any) -> None:
    """Close ``proposer`` (writing its snapshot) at process exit if still alive, holding no strong reference. A forked
    engine process ends with ``os._exit`` after multiprocessing's exit finalizers, hence the second hook."""
    ref = weakref.ref(proposer)
    atexit.register(_close_if_alive, ref)
    multiprocessing.util.Finalize(None, _close_if_alive, args=(ref,), exitpriority=100)


def _close_if_alive(ref: weakref.ref) -> None:
    proposer = ref()
    if proposer is not None:
        proposer.close()
