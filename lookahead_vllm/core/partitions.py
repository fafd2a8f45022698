"""Partitions: which requests draft from each other's outputs (tenant isolation; config ``draft_sharing``: its
policies in docs/configuration.md). Drafts change timing, a side channel, so the corpus is isolated by vLLM's
``cache_salt`` as vLLM isolates its prefix cache. A freed salted partition (:meth:`Partitions.release`) holds nothing,
so a new salt never sees an old one's outputs; ids are reused lowest first (every tensor-parallel rank numbers alike).
Past :data:`MAX_PARTITION` ids in use, a new salt drafts PRIVATE.

  partition  an int of the draft index: a request drafts from its own text and its partition's outputs only.
             ``DEFAULT`` (0): requests without a salt; ``PRIVATE`` (-1): none at all (own text only).
  label      a partition's name in a snapshot: ``""`` for the default one, ``"sha256:<hex>"`` of the salt for a
             salted one (the salt itself is never written).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable

from lookahead_vllm.core.config import DRAFT_SHARINGS
from lookahead_vllm.core.draft_index import DEFAULT, MAX_PARTITION, PRIVATE

DEFAULT_LABEL = ""
SWEEP_FIRST = 256  # labelled partitions at which the first sweep (Partitions.release) is due


def salt_label(salt: str) -> str:
    """A salted partition's label: the salt's SHA-256 (the salt stays secret)."""
    return "sha256:" + hashlib.sha256(salt.encode("utf-8")).hexdigest()


class Partitions:
    """Salts (and snapshot labels) -> draft index partitions under one sharing policy (docs/configuration.md);
    salted ones numbered from 1, an id reused only after :meth:`release` freed it."""

    def __init__(self, sharing: str = "per-salt") -> None:
        if sharing not in DRAFT_SHARINGS:
            raise ValueError(f"draft_sharing={sharing!r}: must be one of {DRAFT_SHARINGS}")
        self.sharing = sharing
        self._by_label: dict[str, int] = {}
        self._labels: dict[int, str] = {DEFAULT: DEFAULT_LABEL}  # partition id -> label
        self._free: list[int] = []  # released ids (a heap: the lowest is reused first)
        self._next = DEFAULT + 1  # the next id never used
        self._sweep_at = SWEEP_FIRST

    @property
    def per_salt(self) -> bool:
        return self.sharing in ("per-salt", "per-salt-saved")

    def of_salt(self, salt: str | None) -> int:
        """The partition of a request carrying ``salt`` (None or "": no salt)."""
        if self.sharing == "none":
            return PRIVATE
        if not salt or not self.per_salt:
            return DEFAULT
        return self._of_label(salt_label(salt))

    def of_label(self, label: str) -> int | None:
        """The partition a snapshot's ``label`` restores into (None: not under this policy)."""
        if self.sharing == "none" or (label != DEFAULT_LABEL and not self.per_salt):
            return None
        return DEFAULT if label == DEFAULT_LABEL else self._of_label(label)

    def _of_label(self, label: str) -> int:
        partition = self._by_label.get(label)
        if partition is None:
            if self._free:
                partition = heapq.heappop(self._free)
            elif self._next <= MAX_PARTITION:
                partition, self._next = self._next, self._next + 1
            else:  # every id in use at once: the request keeps to its own text
                return PRIVATE
            self._by_label[label] = partition
            self._labels[partition] = label
        return partition

    def label(self, partition: int) -> str:
        return self._labels[partition]

    def saved(self) -> list[int]:
        """The partitions a snapshot writes, by id."""
        if self.sharing == "none":
            return []
        return sorted(self._labels) if self.sharing == "per-salt-saved" else [DEFAULT]

    @property
    def labelled(self) -> int:
        """Partitions with a label (the default one included)."""
        return len(self._labels)

    def sweep_due(self) -> bool:
        """Whether enough salts arrived since the last :meth:`release` to call it again."""
        return len(self._labels) >= self._sweep_at

    def release(self, in_use: Iterable[int]) -> int:
        """Drop every salted partition not in ``in_use`` (its id is reused); returns how many were dropped.
        Next due at twice the partitions kept."""
        keep = set(in_use)
        dropped = [p for p in self._labels if p != DEFAULT and p not in keep]
        for p in dropped:
            del self._by_label[self._labels.pop(p)]
            heapq.heappush(self._free, p)
        self._sweep_at = max(SWEEP_FIRST, 2 * len(self._labels))
        return len(dropped)
