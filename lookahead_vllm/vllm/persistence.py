"""Warm start and snapshots at engine start and shutdown.

``Persistence`` does, for one proposer, what the config's ``warm_start`` and
``snapshot_path`` ask for:

  start   load the snapshot (core/snapshot.py) if its file exists, then
          learn the ``warm_start`` texts (core/warm_start.py) with the model's
          tokenizer, unless the snapshot was written with that file. A corrupt,
          truncated or foreign snapshot is refused with a warning (drafting
          starts cold) and kept: moved to ``<path>.refused`` (``.refused.1``,
          ... when taken), so that this run's snapshot does not overwrite it.
          One that could not be judged (unreadable, not a regular file, the
          tokenizer failed) or moved stays where it is, and this run writes
          no snapshot.
  close   write the snapshot (atomically) once: on engine shutdown, from the
          proposer's ``close()``, its finalizer or ``atexit``.

Tensor-parallel ranks hold identical drafters and write the same bytes, each
through its own temporary file; in tree mode, where each rank verifies its own
drafter's trees, ranks that learned different things at start (a file one of
them could not read) all start cold and write nothing (the proposer checks).

Data-parallel engines learn apart: the engine of data-parallel rank 0 (or the
only one) keeps ``snapshot_path``, rank ``r`` keeps ``<path>.dp<r>``
(:func:`snapshot_file`; ``r`` vLLM's ``data_parallel_index``, the global rank,
``--data-parallel-rank`` included) and, while it has no usable one (none yet,
or its own refused), starts from rank 0's file, read only (never moved aside:
it is rank 0's). Servers that are not data-parallel ranks of one deployment and
share a path still overwrite each other (the last one wins).

The tokenizer (loaded only when one of the two is set) also names the
snapshot's identity: folder name and vocabulary size.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import stat
import time
import weakref
from typing import Any

from vllm.logger import init_logger

from lookahead_vllm.core.config import Settings
from lookahead_vllm.core.snapshot import Snapshot, SnapshotError, SnapshotUnreadable, file_digest, identity_of
from lookahead_vllm.core.warm_start import read_warm_texts

logger = init_logger(__name__)

# Texts tokenized per batch (progress is logged per batch on big files).
TOKENIZE_BATCH = 1024


def snapshot_file(path: str, dp_rank: int) -> str:
    """The snapshot file of the engine of data-parallel rank ``dp_rank`` (module docstring)."""
    return f"{path}.dp{dp_rank}" if path and dp_rank else path


class Persistence:
    """See the module docstring."""

    def __init__(self, config: Settings, model_config: Any, dp_rank: int = 0) -> None:
        self.config = config
        self.model_config = model_config
        # This engine's file, and the file it starts from while it has none (rank 0's).
        self.path = snapshot_file(config.snapshot_path, dp_rank)
        self._shared = config.snapshot_path if self.path != config.snapshot_path else ""
        self._tokenizer: Any = None
        self._identity: dict | None = None
        self._warm_digest = ""
        self.closed = False
        # False once a snapshot was left in place unloaded: writing would overwrite it.
        self.writes = True
        # What start() learned: the snapshot loaded (file, outputs, tokens) and the warm-start
        # texts (texts, tokens); tensor-parallel ranks compare it in tree mode (the proposer).
        self.learned: dict[str, tuple] = {}

    # ---------------------------------------------------------------- start
    def start(self, drafter: Any) -> None:
        """Learn the snapshot, then the warm-start texts (see the module docstring)."""
        path, unread = self.config.warm_start, None
        if path and os.path.isfile(path):
            try:
                self._warm_digest = file_digest(path)
            except OSError as exc:  # a warm start never stops the engine
                unread = exc.strerror or str(exc)
        snap = self._load_snapshot(drafter)
        if not path:
            return
        # The warm-start file the snapshot holds: what the snapshot written at shutdown names
        # unless this run learns the file whole (it must never name a file it does not hold).
        held = snap.info.get("warm_start", "") if snap is not None else ""
        if self._warm_digest and held == self._warm_digest:
            logger.info("lookahead warm_start %s: already in the snapshot, not read again", path)
            return
        learned = False
        if unread is not None:  # whether the snapshot holds it cannot be told: not learned (twice) this run
            logger.warning("lookahead warm_start %s: cannot be read (%s); not learned this run", path, unread)
        else:
            try:
                learned = self._warm(drafter)
            except Exception as exc:  # noqa: BLE001 - a warm start never stops the engine
                logger.warning("lookahead warm_start %s: not learned (%r)", path, exc)
        if not learned:
            self._warm_digest = held

    def _load_snapshot(self, drafter: Any) -> Snapshot | None:
        path = self.path
        if not path:
            return None
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            if self._shared and os.path.isfile(self._shared):
                return self._load_shared(drafter)
            logger.info("lookahead snapshot %s: no file yet; drafting starts cold (written on shutdown)", path)
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
                return self._load_shared(drafter) if self._shared else None
            return self._keep(path, str(exc).removeprefix(f"snapshot {path}: "))
        except SnapshotError as exc:
            self._set_aside(path, str(exc), "starts from data-parallel rank 0's file" if self._shared else "")
            # Where this engine's own file was refused, every tensor-parallel rank starts alike:
            # from rank 0's file (the ranks that find the file already moved aside do the same).
            return self._load_shared(drafter) if self._shared else None
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops the engine
            return self._keep(path, f"could not be loaded ({exc!r})")
        logger.info("lookahead snapshot %s loaded: %d outputs, %d tokens, %d trie nodes (%.2f s)", path,
                    len(snap.sequences), snap.num_tokens, 0 if snap.trie is None else len(snap.trie.tokens),
                    time.perf_counter() - start)
        return self._learned(path, snap)

    def _load_shared(self, drafter: Any) -> Snapshot | None:
        """Start from data-parallel rank 0's snapshot (this engine has no usable one of its own):
        read only; whatever goes wrong, drafting starts cold and the file stays as it is."""
        path = self._shared
        try:
            snap = drafter.load_snapshot(path, self.identity())
        except Exception as exc:  # noqa: BLE001 - a snapshot never stops the engine
            logger.warning("lookahead snapshot %s: not loaded (%s); drafting starts cold", path,
                           str(exc).removeprefix(f"snapshot {path}: "))
            return None
        logger.info("lookahead snapshot %s loaded (data-parallel rank 0's; this engine's own is %s): "
                    "%d outputs, %d tokens", path, self.path, len(snap.sequences), snap.num_tokens)
        return self._learned(path, snap)

    def _learned(self, path: str, snap: Snapshot) -> Snapshot:
        """Book the snapshot loaded from ``path`` in ``learned``; returns it."""
        self.learned["snapshot"] = (path, len(snap.sequences), snap.num_tokens, snap.info.get("written_at"))
        return snap

    def _keep(self, path: str, why: str) -> None:
        """A snapshot not judged (unreadable, not a file, no identity) stays as it is, and this
        run writes none over it."""
        self.writes = False
        logger.warning("lookahead snapshot %s: %s; drafting starts cold, and no snapshot is written there this run",
                       path, why)

    def _set_aside(self, path: str, why: str, instead: str = "") -> None:
        """Keep a refused snapshot out of this run's way: renamed to the first free
        ``<path>.refused[.N]``; where it cannot be, this run writes none (``writes``).
        ``instead``: what drafting does (default: starts cold)."""
        aside, n = f"{path}.refused", 0
        while os.path.lexists(aside):
            n += 1
            aside = f"{path}.refused.{n}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:  # gone meanwhile (another rank of this engine moved it)
            logger.warning("lookahead %s; refused, drafting %s", why, instead or "starts cold")
        except OSError as exc:
            self.writes = False
            logger.warning("lookahead %s; refused, drafting %s, and no snapshot is written to %s this run "
                           "(the file could not be moved aside: %s)", why, instead or "starts cold", path,
                           exc.strerror or exc)
        else:
            logger.warning("lookahead %s; refused and kept as %s, drafting %s", why, aside, instead or "starts cold")

    def _warm(self, drafter: Any) -> bool:
        """Learn the warm-start texts; whether the file was read (every text learned)."""
        path = self.config.warm_start
        start = time.perf_counter()
        try:
            found = read_warm_texts(path)
        except OSError as exc:
            logger.warning("lookahead warm_start %s: cannot be read (%s); drafting starts cold", path,
                           exc.strerror or exc)
            return False
        if found.skipped_lines:
            logger.warning("lookahead warm_start %s: skipped %d line(s) without a text field (first: line %d)",
                           path, len(found.skipped_lines), found.skipped_lines[0])
        tokens = 0
        texts = found.texts
        for at in range(0, len(texts), TOKENIZE_BATCH):
            for ids in self.tokenizer()(texts[at:at + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"]:
                drafter.warm(ids)
                tokens += len(ids)
            if len(texts) > TOKENIZE_BATCH:
                logger.info("lookahead warm_start %s: %d/%d texts", path, min(at + TOKENIZE_BATCH, len(texts)),
                            len(texts))
        self.learned["warm_start"] = (len(texts), tokens)
        logger.info("lookahead warm_start %s: learned %d texts, %d tokens (%.2f s)", path, len(texts), tokens,
                    time.perf_counter() - start)
        return True

    # ------------------------------------------------------------- shutdown
    def close(self, drafter: Any) -> None:
        """Write the snapshot (once; later calls do nothing). Never raises."""
        closed, self.closed = self.closed, True
        if not closed and self.config.snapshot_path:
            self.save(drafter)

    def save(self, drafter: Any) -> Snapshot | None:
        """Write the snapshot now (a failure is logged, not raised; nothing where the snapshot
        found at start was left in place unloaded: ``writes``)."""
        path = self.path
        if not self.writes:
            logger.warning("lookahead snapshot %s: not written (the snapshot found there at start is kept)", path)
            return None
        try:
            info = {"warm_start": self._warm_digest, "written_at": time.time()}
            snap = drafter.save_snapshot(path, self.identity(), info)
        except Exception as exc:  # noqa: BLE001 - shutdown must not fail over a snapshot
            logger.warning("lookahead snapshot %s: not written (%s)", path, exc)
            return None
        logger.info("lookahead snapshot %s written: %d outputs, %d tokens, %d trie nodes", path,
                    len(snap.sequences), snap.num_tokens, 0 if snap.trie is None else len(snap.trie.tokens))
        return snap

    # ------------------------------------------------------------ tokenizer
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            mc = self.model_config
            name = getattr(mc, "tokenizer", None) or mc.model
            self._tokenizer = AutoTokenizer.from_pretrained(
                name, revision=getattr(mc, "tokenizer_revision", None),
                trust_remote_code=bool(getattr(mc, "trust_remote_code", False)))
        return self._tokenizer

    def identity(self) -> dict:
        """The snapshot identity: tokenizer folder name and vocabulary size."""
        if self._identity is None:
            mc = self.model_config
            self._identity = identity_of(getattr(mc, "tokenizer", None) or mc.model, len(self.tokenizer()))
        return self._identity


def close_at_exit(proposer: Any) -> None:
    """Close ``proposer`` (writing its snapshot) at process exit if it is
    still alive then; holds no strong reference to it. ``atexit`` covers the
    main process and spawned engine processes; a forked engine process ends
    with ``os._exit`` after running multiprocessing's exit finalizers, hence
    the second registration (closing twice writes once)."""
    ref = weakref.ref(proposer)
    atexit.register(_close_if_alive, ref)
    multiprocessing.util.Finalize(None, _close_if_alive, args=(ref,), exitpriority=100)


def _close_if_alive(ref: weakref.ref) -> None:
    proposer = ref()
    if proposer is not None:
        proposer.close()
