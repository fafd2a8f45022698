"""Pure-Python reference of the native draft index
(``csrc/draft_index/draft_index.cpp``): the same class with the same drafts,
counts and charges, the oracle tests hold the native index to. The terms are
defined in docs/how-it-works.md, "The draft index".
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from lookahead_vllm.core.draft_index import (DEFAULT, ENTRY_CHARGE, KEY_CHARGE, MAX_PARTITION, PRIVATE,
                                             SEQUENCE_CHARGE, TOKEN_CHARGE, DraftIndexConfig)

OWN, CORPUS = 0, 1


class _Sequence:
    __slots__ = ("tokens", "prompt_len", "own", "partition")

    def __init__(self, prompt_len: int, partition: int) -> None:
        self.tokens: list[int] = []
        self.prompt_len = prompt_len
        self.own: dict[tuple[int, ...], list[int]] = {}
        self.partition = partition


class _Partition:
    """One partition's share of the corpus and of its charge."""

    __slots__ = ("finished", "finished_tokens", "entries", "keys", "live")

    def __init__(self) -> None:
        self.finished: OrderedDict[int, None] = OrderedDict()  # its finished sequences, oldest first
        self.finished_tokens = 0
        self.entries = 0  # corpus entries of its keys
        self.keys = 0  # its corpus keys
        self.live = 0  # its running sequences

    def charge(self) -> int:
        return (SEQUENCE_CHARGE * len(self.finished) + TOKEN_CHARGE * self.finished_tokens
                + ENTRY_CHARGE * self.entries + KEY_CHARGE * self.keys)


def check_partition(partition: int) -> int:
    if isinstance(partition, bool) or not isinstance(partition, (int, np.integer)) \
            or not PRIVATE <= partition <= MAX_PARTITION:
        raise ValueError(f"partition={partition!r}: must be an int in [{PRIVATE}, {MAX_PARTITION}]")
    return int(partition)


class DraftIndex:
    """Pure-Python reference of the drafting core (docs/how-it-works.md, "The draft index")."""

    native = False
    # The upkeep runs where it is due, never on a thread of its own.
    upkeep_thread = False

    def __init__(self, config: DraftIndexConfig) -> None:
        self.config = config
        self._live: dict[int, _Sequence] = {}
        # Outputs in the corpus: sequence id -> output tokens (live ones grow).
        self._outputs: dict[int, list[int]] = {}
        # Sequence id -> its partition (the sequences in ``_outputs``).
        self._partition_of: dict[int, int] = {}
        # Partition id -> its record (finished sequences, oldest first; charge counts).
        self._parts: dict[int, _Partition] = {}
        # Totals over the partitions: finished sequences and their output tokens.
        self._num_finished = 0
        self._finished_tokens = 0
        # (partition, *n-gram) -> entries (sequence id, position), oldest first.
        self._corpus: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._entries = 0  # corpus entries, over all keys
        # Upkeep: output n-grams waiting to join the corpus, (sequence id, position).
        self._pending: list[tuple[int, int]] = []

    # ------------------------------------------------------------ lifecycle
    def add(self, sid: int, tokens: Sequence[int], prompt_len: int, partition: int = DEFAULT) -> None:
        """Admit sequence ``sid`` with its first ``tokens`` (the prompt, and
        any output already generated: ``tokens[prompt_len:]``) into
        ``partition`` (docs/how-it-works.md, "The draft index")."""
        self.settle()
        self._add(sid, tokens, prompt_len, partition)

    def _add(self, sid: int, tokens: Sequence[int], prompt_len: int, partition: int = DEFAULT) -> None:
        if sid in self._live or sid in self._outputs:
            raise KeyError(f"sequence {sid} is already in the index")
        if not 0 <= prompt_len <= len(tokens):
            raise ValueError(f"prompt_len={prompt_len}: must be in [0, {len(tokens)}]")
        partition = check_partition(partition)
        self._live[sid] = _Sequence(prompt_len, partition)
        self._outputs[sid] = []
        self._partition_of[sid] = partition
        if partition != PRIVATE:
            self._part(partition).live += 1
        self._extend(sid, tokens)

    def _part(self, partition: int) -> _Partition:
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Partition()
        return part

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        """Append committed tokens of a running sequence."""
        self.settle()
        self._extend(sid, tokens)

    def _extend(self, sid: int, tokens: Sequence[int]) -> None:
        seq = self._live[sid]
        n, cap = self.config.ngram, self.config.max_occurrences
        out = self._outputs[sid]
        for t in tokens:
            seq.tokens.append(int(t))
            p = len(seq.tokens) - 1  # position of the new token: it follows tokens[p-n:p]
            if p >= n:
                _push(seq.own.setdefault(tuple(seq.tokens[p - n:p]), []), p, cap)
            if p >= seq.prompt_len:
                out.append(int(t))
                q = len(out) - 1
                if q >= n and seq.partition != PRIVATE:
                    self._pending.append((sid, q))

    def finish(self, sid: int) -> None:
        """The sequence finished or was aborted: its own index goes, its
        output stays in the corpus (the next upkeep evicts the oldest outputs
        over the cap). Unknown ids are ignored."""
        seq = self._live.pop(sid, None)
        if seq is None:
            return
        if seq.partition == PRIVATE:  # nothing of it joined the corpus
            self._evict(sid, PRIVATE)
            return
        part = self._parts[seq.partition]
        part.live -= 1
        part.finished[sid] = None
        part.finished_tokens += len(self._outputs[sid])
        self._num_finished += 1
        self._finished_tokens += len(self._outputs[sid])

    def settle(self) -> None:
        """Run the pending upkeep (docs/how-it-works.md, "The draft index") now."""
        n, cap = self.config.ngram, self.config.max_occurrences
        for sid, q in self._pending:
            out = self._outputs[sid]
            partition = self._partition_of[sid]
            part = self._parts[partition]
            key = (partition, *out[q - n:q])
            entries = self._corpus.get(key)
            if entries is None:
                entries = self._corpus[key] = []
                part.keys += 1
            self._entries -= len(entries)
            part.entries -= len(entries)
            _push(entries, (sid, q), cap)
            self._entries += len(entries)
            part.entries += len(entries)
        self._pending.clear()
        while self._num_finished and self._charge() > self.config.corpus_bytes:
            self._evict_oldest(self._fullest())

    def _fullest(self) -> int:
        """The partition whose finished outputs go first: charged the most (ties: the lowest id)."""
        return max((p for p, part in self._parts.items() if part.finished),
                   key=lambda p: (self._parts[p].charge(), -p))

    def _evict_oldest(self, partition: int) -> None:
        part = self._parts[partition]
        old, _ = part.finished.popitem(last=False)
        size = len(self._outputs[old])
        part.finished_tokens -= size
        self._num_finished -= 1
        self._finished_tokens -= size
        self._evict(old, partition)

    def rewind(self, sid: int, length: int) -> None:
        """The runner dropped committed tokens past ``length`` (preemption):
        the sequence is indexed anew from its first ``length`` tokens."""
        self.settle()
        seq = self._live[sid]
        if length < 0:
            raise ValueError(f"length={length}: must be >= 0")
        tokens, prompt_len = seq.tokens[:length], min(seq.prompt_len, length)
        del self._live[sid]
        self._evict(sid, seq.partition)
        if seq.partition != PRIVATE:
            self._parts[seq.partition].live -= 1
        self._add(sid, tokens, prompt_len, seq.partition)

    def _evict(self, sid: int, partition: int) -> None:
        """Drop a sequence's output and its corpus entries (a finished
        sequence already taken off its partition's ``finished``, or a running
        one rewound)."""
        out = self._outputs.pop(sid)
        del self._partition_of[sid]
        if partition == PRIVATE:
            return
        part = self._parts[partition]
        n = self.config.ngram
        for q in range(n, len(out)):
            key = (partition, *out[q - n:q])
            entries = self._corpus.get(key)
            if entries is None:
                continue
            self._entries -= len(entries)
            part.entries -= len(entries)
            entries[:] = [e for e in entries if e[0] != sid]
            self._entries += len(entries)
            part.entries += len(entries)
            if not entries:
                del self._corpus[key]
                part.keys -= 1

    # ----------------------------------------------------------------- stats
    def num_live(self) -> int:
        return len(self._live)

    def num_sequences(self) -> int:
        """Sequences held: running ones and finished outputs in the corpus."""
        self.settle()
        return len(self._outputs)

    def corpus_tokens(self) -> int:
        """Finished output tokens held in the corpus."""
        self.settle()
        return self._finished_tokens

    def corpus_bytes(self) -> int:
        """The corpus's charge (docs/how-it-works.md, "The draft index"), what ``corpus_bytes`` caps."""
        self.settle()
        return self._charge()

    def _charge(self) -> int:
        return (SEQUENCE_CHARGE * self._num_finished + TOKEN_CHARGE * self._finished_tokens
                + ENTRY_CHARGE * self._entries + KEY_CHARGE * len(self._corpus))

    def partition_bytes(self) -> dict[int, int]:
        """Partition -> its charge, for the partitions holding a running
        sequence or a finished output (``PRIVATE`` is none), by id."""
        self.settle()
        return {p: part.charge() for p, part in sorted(self._parts.items()) if part.live or part.finished}

    def corpus_sequences(self, partition: int | None = None) -> list[list[int]]:
        """Finished outputs held in the corpus of ``partition`` (None: of
        every partition, by partition id), oldest first: adding and finishing
        them in this order into an empty index (in their partitions) rebuilds
        its corpus."""
        self.settle()
        parts = sorted(self._parts) if partition is None else [partition]
        return [list(self._outputs[sid]) for p in parts if p in self._parts for sid in self._parts[p].finished]

    def memory_bytes(self) -> int:
        """Estimate of the native layout's size: 8 bytes per running token
        (text and previous-occurrence chain), 4 per output token, 16 per
        corpus entry, and hash-table slots (8 per distinct own n-gram, 16 per
        distinct corpus n-gram, tables at most 3/4 full)."""
        self.settle()
        running = sum(len(s.tokens) for s in self._live.values())
        outputs = sum(map(len, self._outputs.values()))
        entries = sum(len(v) for v in self._corpus.values())
        own_keys = sum(len(s.own) for s in self._live.values())
        return 8 * running + 4 * outputs + 16 * entries + int((8 * own_keys + 16 * len(self._corpus)) * 4 / 3)

    def length(self, sid: int) -> int:
        """Tokens of running sequence ``sid`` (-1 if unknown)."""
        seq = self._live.get(sid)
        return -1 if seq is None else len(seq.tokens)

    # ------------------------------------------------------------- drafting
    def draft(self, sid: int, budget: int, floor: float = 0.0, tree: bool = False
              ) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, confidences) of one sequence's draft (docs/how-it-works.md,
        "The draft index"). Parents index earlier nodes, -1 = the root."""
        self.settle()
        return self._draft(sid, budget, floor, tree) or ([], [], [])

    def _draft(self, sid: int, budget: int, floor: float, tree: bool
               ) -> tuple[list[int], list[int], list[float]] | None:
        """:meth:`draft`, or None where the sequence has no candidate at all."""
        if budget <= 0 or sid not in self._live:
            return None
        cands = self._candidates(sid)
        if not cands:
            return None
        nodes = self._merge(sid, cands, budget)
        return _select_chain(nodes, budget, floor) if not tree else _select_tree(nodes, budget, floor)

    def draft_batch(self, sids: Sequence[int], budgets: Sequence[int], floor: float = 0.0, tree: bool = False,
                    threads: int = 1, backoff: "DraftIndex | None" = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Drafts of many sequences: ``tokens [B, K]`` int32, ``parents [B, K]``
        int32, ``confidence [B, K]`` float64, ``lengths [B]`` int32 with
        ``K = max(budgets)``; row ``i`` holds ``lengths[i]`` nodes. ``backoff``
        (another index, usually keyed by fewer tokens) drafts the rows for
        which this one finds no candidate at all (a row whose candidates the
        floor cuts keeps its empty draft). The native index spreads the rows
        over up to ``threads`` threads (the drafts do not depend on it; here
        it is only checked). Then both indexes run their pending upkeep."""
        if not 1 <= threads <= 256:
            raise ValueError(f"threads={threads}: must be in [1, 256]")
        if backoff is self:
            raise ValueError("backoff: must be another index")
        width = max((int(b) for b in budgets), default=0)
        tokens = np.zeros((len(sids), width), np.int32)
        parents = np.full((len(sids), width), -1, np.int32)
        conf = np.zeros((len(sids), width), np.float64)
        lengths = np.zeros(len(sids), np.int32)
        for i, (sid, budget) in enumerate(zip(sids, budgets)):
            row = self._draft(int(sid), int(budget), floor, tree)
            if row is None and backoff is not None:
                row = backoff._draft(int(sid), int(budget), floor, tree)
            t, p, c = row or ([], [], [])
            lengths[i] = len(t)
            tokens[i, :len(t)], parents[i, :len(t)], conf[i, :len(t)] = t, p, c
        self.settle()
        if backoff is not None:
            backoff.settle()
        return tokens, parents, conf, lengths

    def sync(self, sids: Sequence[int], rows: Sequence[int], token_ids: np.ndarray,
             num_tokens: Sequence[int], prompt_lens: Sequence[int], backoff: "DraftIndex | None" = None,
             partitions: Sequence[int] | None = None, sampled: Sequence[int] | None = None) -> int:
        """Bring many sequences up to date with the runner's token table:
        ``token_ids[rows[i], :num_tokens[i]]`` (``[max_rows, max_len]``) are
        sequence ``sids[i]``'s committed tokens. Unknown ids are admitted
        (``prompt_lens[i]`` prompt tokens) into ``partitions[i]`` (None: all
        ``DEFAULT``), shorter ones rewound, longer ones extended; the last
        ``sampled[i]`` tokens (None: none) were sampled this step, so a
        sequence holding more than the tokens before them is rewound to those
        first. ``backoff`` (another index) is synced the same way in the same
        call. Returns how many were rewound (of this index)."""
        if backoff is self:
            raise ValueError("backoff: must be another index")
        if partitions is not None and len(partitions) != len(sids):
            raise ValueError("sids and partitions must have the same length")
        if sampled is not None and len(sampled) != len(sids):
            raise ValueError("sids and sampled must have the same length")
        if sampled is not None and any(not 0 <= int(s) <= int(n) for s, n in zip(sampled, num_tokens)):
            raise ValueError("sampled: each must be in [0, num_tokens]")
        if backoff is not None:
            backoff.sync(sids, rows, token_ids, num_tokens, prompt_lens, partitions=partitions, sampled=sampled)
        self.settle()
        rewound = 0
        for i, sid in enumerate(sids):
            sid, row, n = int(sid), int(rows[i]), int(num_tokens[i])
            have = self.length(sid)
            if have < 0:
                self._add(sid, token_ids[row, :n].tolist(), min(int(prompt_lens[i]), n),
                          DEFAULT if partitions is None else partitions[i])
                continue
            kept = n if sampled is None else n - int(sampled[i])  # tokens from before this step
            if kept < have:
                self.rewind(sid, kept)
                have = kept
                rewound += 1
            if n > have:
                self._extend(sid, token_ids[row, have:n].tolist())
        return rewound

    def _candidates(self, sid: int) -> list[tuple[int, int, int, int]]:
        """Ranked ``(m, scope, sequence id, position)``, at most max_candidates."""
        cfg = self.config
        text = self._live[sid].tokens
        end = len(text)
        if end < cfg.ngram:
            return []
        key = tuple(text[end - cfg.ngram:])
        found = []
        seq = self._live[sid]
        for p in reversed(seq.own.get(key, ())):
            found.append((_match(text, p, text, end, cfg), OWN, sid, p))
        shared = self._corpus.get((seq.partition, *key), ()) if seq.partition != PRIVATE else ()
        for other, q in reversed(shared):
            if other != sid:
                found.append((_match(self._outputs[other], q, text, end, cfg), CORPUS, other, q))
        found.sort(key=lambda c: (-c[0], c[1]))  # stable: most recent first within ties
        return found[:cfg.max_candidates]

    def _continuation(self, sid: int, scope: int, other: int, pos: int, budget: int) -> list[int]:
        if scope == CORPUS:
            return self._outputs[other][pos:pos + budget]
        text = self._live[sid].tokens
        cont = text[pos:pos + budget]
        period = len(text) - pos
        while len(cont) < budget:
            cont.append(cont[len(cont) - period])
        return cont

    def _merge(self, sid: int, cands: list[tuple[int, int, int, int]], budget: int) -> list[list]:
        """The candidates' continuations as a token tree: nodes
        ``[token, parent, W, M, depth, children]``, node 0 the root."""
        nodes: list[list] = [[-1, -1, 0, 0, 0, {}]]
        for m, scope, other, pos in cands:
            nodes[0][2] += m
            at = 0
            for t in self._continuation(sid, scope, other, pos, budget):
                child = nodes[at][5].get(t)
                if child is None:
                    child = len(nodes)
                    nodes.append([t, at, 0, 0, nodes[at][4] + 1, {}])
                    nodes[at][5][t] = child
                nodes[child][2] += m
                nodes[child][3] = max(nodes[child][3], m)
                at = child
        return nodes


def _push(entries: list, value, cap: int) -> None:
    entries.append(value)
    if len(entries) > cap:
        del entries[0]


def _match(src: list[int], pos: int, text: list[int], end: int, cfg: DraftIndexConfig) -> int:
    """How many tokens before ``src[pos]`` agree with the tokens before
    ``text[end]`` (at least ngram: the key matched), at most max_match."""
    m = cfg.ngram
    while (m < cfg.max_match and pos - m - 1 >= 0 and end - m - 1 >= 0
           and src[pos - m - 1] == text[end - m - 1]):
        m += 1
    return m


def _confidence(nodes: list[list], i: int) -> float:
    """``(W / W_root) * q(M) ** depth`` (the power as repeated products, as
    the native core computes it)."""
    _, _, w, m, depth, _ = nodes[i]
    q = m / (m + 1.0)
    c = w / nodes[0][2]
    for _ in range(depth):
        c *= q
    return c


def _select_chain(nodes: list[list], budget: int, floor: float) -> tuple[list[int], list[int], list[float]]:
    tokens, parents, confs = [], [], []
    at = 0
    while nodes[at][5] and len(tokens) < budget:
        best = -1
        for child in nodes[at][5].values():  # creation order: ties keep the better-ranked candidate's
            if best < 0 or nodes[child][2] > nodes[best][2]:
                best = child
        c = _confidence(nodes, best)
        if c < floor:
            break
        parents.append(len(tokens) - 1)
        tokens.append(nodes[best][0])
        confs.append(c)
        at = best
    return tokens, parents, confs


def _select_tree(nodes: list[list], budget: int, floor: float) -> tuple[list[int], list[int], list[float]]:
    conf = [1.0] + [_confidence(nodes, i) for i in range(1, len(nodes))]
    picked = set()
    frontier = [c for c in nodes[0][5].values()]
    while frontier and len(picked) < budget:
        best = max(frontier, key=lambda i: (conf[i], -i))
        if conf[best] < floor:
            break
        frontier.remove(best)
        picked.add(best)
        frontier.extend(nodes[best][5].values())
    tokens, parents, confs = [], [], []
    stack = [(c, -1) for c in sorted((c for c in nodes[0][5].values() if c in picked),
                                     key=lambda i: (conf[i], -i))]
    while stack:  # depth-first, most confident child first
        node, parent = stack.pop()
        idx = len(tokens)
        tokens.append(nodes[node][0])
        parents.append(parent)
        confs.append(conf[node])
        kids = sorted((c for c in nodes[node][5].values() if c in picked), key=lambda i: (conf[i], -i))
        stack.extend((c, idx) for c in kids)
    return tokens, parents, confs
