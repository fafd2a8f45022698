"""Partitions: which requests draft from each other's outputs (tenant isolation).

Speculative decoding never changes a token, but it changes timing: how many
draft tokens a step accepts tells a client whether someone else's text
continues its prompt the same way. vLLM isolates its prefix cache per tenant
with a request's ``cache_salt``; the drafter isolates its corpus the same way.

Terms:

  partition  an int of the draft index (core/draft_index.py): a request
             drafts from its own text and from the outputs of its partition
             only. ``DEFAULT`` (0) is shared by requests without a salt;
             ``PRIVATE`` (-1) is none at all (own text only).
  label      a partition's name in a snapshot: ``""`` for the default one,
             ``"sha256:<hex>"`` of the salt for a salted one (the salt itself
             is never written).
  sharing    the policy, config ``draft_sharing``:

             ==============  ===============  ================  ==============
             sharing         salted request   unsalted request  snapshot keeps
             ==============  ===============  ================  ==============
             per-salt        its salt's       DEFAULT           DEFAULT
             per-salt-saved  its salt's       DEFAULT           all partitions
             all             DEFAULT          DEFAULT           DEFAULT
             none            PRIVATE          PRIVATE           nothing
             ==============  ===============  ================  ==============

Worked example (``per-salt``): requests salted ``"a"``, ``"b"``, ``"a"`` and
one without a salt get partitions 1, 2, 1 and 0; a restart restores only
partition 0's outputs, and with ``per-salt-saved`` also the ``"a"`` and
``"b"`` outputs, each into whatever partition the salt gets then.
"""

from __future__ import annotations

import hashlib

from lookahead_vllm.core.config import DRAFT_SHARINGS
from lookahead_vllm.core.draft_index import DEFAULT, MAX_PARTITION, PRIVATE

DEFAULT_LABEL = ""


def salt_label(salt: str) -> str:
    """A salted partition's label: the salt's SHA-256 (the salt stays secret)."""
    return "sha256:" + hashlib.sha256(salt.encode("utf-8")).hexdigest()


class Partitions:
    """Maps salts (and snapshot labels) to draft index partitions under one
    sharing policy (module docstring). Salted partitions are numbered from 1
    in order of first use and never reused while the engine runs."""

    def __init__(self, sharing: str = "per-salt") -> None:
        if sharing not in DRAFT_SHARINGS:
            raise ValueError(f"draft_sharing={sharing!r}: must be one of {DRAFT_SHARINGS}")
        self.sharing = sharing
        self._by_label: dict[str, int] = {}
        self._labels: list[str] = [DEFAULT_LABEL]  # partition id -> label

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
        """The partition a snapshot's ``label`` restores into (None: not
        under this policy: a salted partition only where salts partition,
        nothing under "none")."""
        if self.sharing == "none" or (label != DEFAULT_LABEL and not self.per_salt):
            return None
        return DEFAULT if label == DEFAULT_LABEL else self._of_label(label)

    def _of_label(self, label: str) -> int:
        partition = self._by_label.get(label)
        if partition is None:
            if len(self._labels) > MAX_PARTITION:
                raise ValueError(f"more than {MAX_PARTITION} salted partitions since the engine started")
            partition = self._by_label[label] = len(self._labels)
            self._labels.append(label)
        return partition

    def label(self, partition: int) -> str:
        return self._labels[partition]

    def saved(self) -> list[int]:
        """The partitions a snapshot writes, by id."""
        if self.sharing == "none":
            return []
        return list(range(len(self._labels))) if self.sharing == "per-salt-saved" else [DEFAULT]
