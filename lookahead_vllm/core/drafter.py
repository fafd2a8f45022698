"""``Drafter``: the engine-wide drafting state behind one batch call per step (docs/how-it-works.md, "The drafting
pipeline"). It owns the native sources (``config.sources``: core/draft_index.py, trie.py, jacobi.py), each keeping
a request's record by an integer *slot* the caller assigns. Per step the caller hands the runner's token table once
(``sync``) and asks for every drafting row's tree (``draft``); finished requests are dropped with ``finish``. Tenant
isolation (core/partitions.py): a request drafts in its salt's partition (``partition``); warm-start texts join the
default one; snapshots keep the partitions the policy saves. The trie is shared: only default-partition requests
feed it and draft from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from lookahead_vllm.core import native
from lookahead_vllm.core.config import Settings
from lookahead_vllm.core.draft_index import DEFAULT, PRIVATE
from lookahead_vllm.core.jacobi import make_jacobi
from lookahead_vllm.core.partitions import Partitions
from lookahead_vllm.core.trie import make_trie

if TYPE_CHECKING:
    from lookahead_vllm.core.snapshot import Snapshot

INDEX_WEIGHT = 1e18  # index nodes rank above any trie count: a chain cut from a merged row follows them


def make_index(config: Settings, ngram: int | None = None) -> Any:
    """The native draft index for ``config``, keyed by ``ngram`` tokens (default the profile's ``index_ngram``)."""
    return native.make_draft_index(config.index_config(ngram), config.profile.upkeep_thread)


def rows_of(count: int, width: int) -> tuple[np.ndarray, ...]:
    """Empty ``[count, width]`` draft rows: tokens, parents (-1: root, parents first), weights, confidence, lengths."""
    return (np.zeros((count, width), np.int32), np.full((count, width), -1, np.int32),
            np.zeros((count, width)), np.zeros((count, width)), np.zeros(count, np.int64))


def trailing_contexts(token_ids: np.ndarray, rows: np.ndarray, ends: np.ndarray, width: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Each row's last ``width`` tokens (of ``token_ids[rows[i], :ends[i]]``) as :meth:`Drafter.draft`'s contexts."""
    ends = np.asarray(ends, np.int64)
    lens = np.minimum(ends, width)
    inside = np.arange(width) < lens[:, None]
    cols = np.where(inside, ends[:, None] - lens[:, None] + np.arange(width), 0)
    return np.where(inside, token_ids[np.asarray(rows, np.int64)[:, None], cols], 0).astype(np.int64), lens


class Drafter:
    """See the module docstring."""

    def __init__(self, config: Settings, partitions: Partitions | None = None) -> None:
        """``partitions``: an earlier drafter's (a reset with requests still running keeps which salt owns which)."""
        self.config = config
        knobs = config.profile
        self.index = make_index(config) if config.uses_index else None
        # Back-off index (shorter key): drafts where the main index has no match.
        self.backoff = make_index(config, knobs.index_backoff) if config.uses_index and knobs.index_backoff else None
        self.trie = make_trie(config) if config.uses_trie else None
        self.jacobi = make_jacobi(config) if config.uses_jacobi else None
        self.threads = knobs.draft_threads
        self.partitions = partitions if partitions is not None else Partitions(config.draft_sharing)
        self._warm_slots = 0  # warm-start texts get slots -1, -2, ... (callers' slots are >= 0)

    def num_requests(self) -> int:
        """Running requests holding drafting state."""
        if self.index is not None:
            return self.index.num_live()
        if self.trie is not None:
            return self.trie.num_slots
        return self.jacobi.num_slots

    def memory_bytes(self) -> int:
        total = sum(index.memory_bytes() for index in self._indexes())
        total += self.jacobi.memory_bytes() if self.jacobi is not None else 0
        return total + (self.trie.num_bytes if self.trie is not None else 0)

    def partition(self, salt: str | None) -> int:
        """The partition a request with vLLM ``cache_salt`` ``salt`` drafts in."""
        return self.partitions.of_salt(salt)

    def release_partitions(self, held: Iterable[int]) -> int:
        """Free the salted partitions that hold nothing: no running request (``held``: the partitions of the requests
        the caller keeps state for, synced here or not yet) and no output in any index. Returns how many were freed."""
        in_use = set(held)
        for index in self._indexes():
            in_use.update(index.partition_bytes())  # settled: running sequences and outputs held
        return self.partitions.release(in_use)

    def partition_stats(self) -> tuple[int, int]:
        """(Partitions holding a request or an output, the corpus's charge in bytes over all, back-off included)."""
        charges = [index.partition_bytes() for index in self._indexes()]
        return len(set().union(*charges)), sum(sum(charge.values()) for charge in charges)

    def sync(self, slots: Sequence[int], rows: Sequence[int], token_ids: np.ndarray, num_tokens: Sequence[int],
             prompt_lens: Sequence[int], partitions: Sequence[int] | None = None,
             sampled: np.ndarray | None = None) -> int:
        """``token_ids[rows[i], :num_tokens[i]]`` are request ``slots[i]``'s committed tokens (its first
        ``prompt_lens[i]`` the prompt, its last ``sampled[i]`` sampled this step): admit new requests (into
        ``partitions[i]``, from :meth:`partition`; None: no salt's), extend or rewind known ones (to before this step's
        samples where an index or the trie held more). Returns how many were rewound."""
        args = (np.asarray(slots, np.int64), np.asarray(rows, np.int64), token_ids,
                np.asarray(num_tokens, np.int64), np.asarray(prompt_lens, np.int64))
        partitions = np.asarray([self.partition(None)] * len(slots) if partitions is None else partitions, np.int64)
        rewound = [] if self.index is None else [self.index.sync(*args, self.backoff, partitions, sampled)]
        if self.trie is not None:
            rewound.append(self.trie.sync(*args, partitions, sampled))
        return int(rewound[0]) if rewound else 0

    def _indexes(self) -> list[Any]:
        return [ix for ix in (self.index, self.backoff) if ix is not None]

    def finish(self, slot: int) -> None:
        """The request finished or was aborted (unknown slots are ignored)."""
        for index in self._indexes():
            index.finish(slot)
        if self.trie is not None:
            self.trie.finish_slot(slot)
        if self.jacobi is not None:
            self.jacobi.finish(slot)

    def warm(self, tokens: Sequence[int]) -> None:
        """Learn a past response (warm start): into the index's corpus as a finished output of the default
        partition, and into the trie as output counts (nothing under ``draft_sharing`` "none")."""
        self._learn(tokens, self.partition(None), self.trie is not None)

    def _learn(self, tokens: Sequence[int], partition: int, trie: bool) -> None:
        if partition == PRIVATE:
            return
        self._warm_slots -= 1
        for index in self._indexes():
            index.add(self._warm_slots, list(tokens), 0, partition=partition)
            index.finish(self._warm_slots)
        if trie and partition == DEFAULT:
            self.trie.insert_output(tokens)

    def draft(self, slots: Sequence[int], contexts: tuple[np.ndarray, np.ndarray] | None, budgets: Sequence[int],
              floor: float, tree: bool, cut: np.ndarray | None = None, pool: tuple[np.ndarray, ...] | None = None
              ) -> tuple[np.ndarray, ...]:
        """Every request's draft as :func:`rows_of` arrays, calibration ``kinds`` before ``lengths``; row ``i`` at most
        ``budgets[i]`` nodes, none below ``floor``: the index's tree (a chain unless ``tree``) or, where it has none,
        the request's context chain, then the trie's nodes, then ``pool``'s row (the Jacobi pool's branches:
        ``jacobi.pool_rows``), merged natively; cut to its best path where ``cut[i]``. ``contexts`` (trie source only,
        else None): the requests' last ``max_match_length`` tokens as ``(tokens [R, W], lengths [R])``."""
        count = len(slots)
        budgets = np.asarray(budgets, np.int64)
        width = max(1, int(budgets.max(initial=0)))
        if self.index is not None:
            tok, par, conf, lens = self.draft_rows(slots, budgets, floor, tree)
            lead = (tok, par, INDEX_WEIGHT * conf, conf, lens.astype(np.int64))
        else:
            lead = rows_of(count, width)
        lead_context = np.zeros(count, bool)
        trie = rows_of(count, 1)
        if self.trie is not None:
            slots = np.asarray(slots, np.int64)
            found = self.trie.retrieve_slots(slots, *contexts, budgets, floor)
            trie, on = found[:5], found[5]
            # Where the index has no draft, the request's context chain leads.
            need = np.flatnonzero((lead[4] == 0) & on.astype(bool) & (budgets > 0))
            if len(need):
                chains = self.trie.context_slots(slots[need], budgets[need], floor)
                n = chains[0].shape[1]
                for a, b in zip(lead, chains):  # [R, W] arrays take the chains' first n columns
                    a[(need, slice(n)) if a.ndim == 2 else need] = b
                lead_context[need] = chains[4] > 0
        return native.extension().merge_rows(lead, lead_context.astype(np.uint8), trie, budgets,
                                             None if cut is None else np.asarray(cut, np.uint8), pool)

    def draft_rows(self, slots: Sequence[int], budgets: Sequence[int], floor: float, tree: bool
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The index's drafts (chains unless ``tree``; the back-off's where the main index finds no candidate) as
        :func:`rows_of` arrays less the weights: ``tokens``, ``parents``, ``confidence [R, W]`` and ``lengths [R]``."""
        s, b = np.asarray(slots, np.int64), np.asarray(budgets, np.int64)
        return self.index.draft_batch(s, b, float(floor), bool(tree), self.threads, self.backoff)

    def snapshot(self, identity: dict, info: dict | None = None) -> "Snapshot":
        """What the drafter learned (core/snapshot.py): the index's corpus in the partitions its policy saves
        (``Partitions.saved``), each output with its partition's label, and the trie's output counts."""
        from lookahead_vllm.core.snapshot import Snapshot, TrieTable, settings_of

        sequences, labels = [], []
        for partition in self.partitions.saved() if self.index is not None else ():
            held = self.index.corpus_sequences(partition)
            sequences += held
            labels += [self.partitions.label(partition)] * len(held)
        table = None
        if self.trie is not None:
            parents, tokens, counts = self.trie.output_counts()
            table = TrieTable(np.asarray(parents, np.int32), np.asarray(tokens, np.int32),
                              np.asarray(counts, np.float64))
        return Snapshot(dict(identity), settings_of(self.config), dict(info or {}), sequences, table, labels)

    def save_snapshot(self, path: str, identity: dict, info: dict | None = None) -> "Snapshot":
        """Write :meth:`snapshot` to ``path`` atomically; returns it."""
        from lookahead_vllm.core.snapshot import write_snapshot

        snap = self.snapshot(identity, info)
        write_snapshot(path, snap)
        return snap

    def load_snapshot(self, path: str, identity: dict) -> "Snapshot":
        """Learn the snapshot at ``path`` (written for ``identity``): its outputs, oldest first, into the index, each
        into the partition its label names under this policy (else skipped), its output counts into the trie (without
        a trie table: its default partition's outputs as warm texts). SnapshotError, before any change, if refused."""
        from lookahead_vllm.core.snapshot import SnapshotError, read_snapshot, settings_of

        snap = read_snapshot(path, identity, settings_of(self.config) if self.trie is not None else None)
        if self.trie is not None and (table := snap.trie) is not None and self.partition(None) == DEFAULT:
            try:  # first: the trie checks the whole table before it changes (depth, counts)
                self.trie.load_output_counts(table.parents.tolist(), table.tokens.tolist(), table.counts.tolist())
            except ValueError as exc:
                raise SnapshotError(f"snapshot {path}: trie table refused: {exc}") from None
        for tokens, label in zip(snap.sequences, snap.labels):
            partition = self.partitions.of_label(label)
            if partition is not None:
                self._learn(tokens, partition, self.trie is not None and snap.trie is None)
        return snap
