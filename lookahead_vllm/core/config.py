"""Lookahead configuration.

Terms:
  decoding length   node budget per step: how many draft tokens (tree nodes,
                    root excluded) one request may put into one forward.
  branch length     maximum depth of a trie branch; also the window size used
                    when prompt and output n-grams are inserted into the trie.
  match length      how many trailing context tokens are matched against the
                    trie before drafting; retrieval tries the longest first and
                    shortens it while the matched sub-trie has fewer than
                    ``min_retrieved_nodes`` candidates (multi-stage matching).
  draft shape       ``hier``: shared prefixes merged into a token tree (seed 000
                    Fig. 2c); ``par``: whole branches side by side, no merging
                    below the root (Fig. 2b); ``one``: a single best branch.

Every field is validated on construction; a bad value raises ``ValueError``
naming the field, the value and the allowed range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

DRAFT_SHAPES = ("hier", "par", "one")
# Draft sources (see ``source`` below): "+"-joined names; "both" = "trie+jacobi".
SOURCES = ("index", "trie", "jacobi", "both", "index+trie", "index+jacobi")
DEBUG_SWITCHES = ("positions", "mask", "compaction")
INDEX_UPKEEPS = ("auto", "thread", "inline")
# Who drafts from whose outputs (``draft_sharing`` below; core/partitions.py).
DRAFT_SHARINGS = ("per-salt", "per-salt-saved", "all", "none")
# Settings that were renamed, and what to use instead.
RENAMED = {"index_corpus_tokens": "index_corpus_bytes (a cap in bytes: an output token is charged 80-190 of it)"}


@dataclass(frozen=True, slots=True)
class LookaheadConfig:
    # Max draft nodes per request per step (root excluded); also vLLM's
    # num_speculative_tokens. 16: on the dev suite's acceptance replay,
    # 16 beat 8 on every class (the forward-cost model keeps only the nodes
    # that pay, so longer drafts go out only where matches are long).
    decoding_length: int = 16
    # Max depth of a trie branch and the insertion window size.
    branch_length: int = 12
    # Longest / shortest trailing context matched against the trie.
    max_match_length: int = 6
    min_match_length: int = 1
    # Stop shortening the match once the sub-trie yields this many nodes.
    min_retrieved_nodes: int = 4
    # Context match (core/context_match.py): the tokens that followed the most
    # recent earlier occurrence of the request's last ``context_match`` tokens
    # (prompt or output) lead its draft, the trie's tree merged after them,
    # so long repeats of the request's own text are drafted whole (what
    # vLLM's ngram method does best). 0 = off; not used with source="jacobi".
    context_match: int = 3
    # Trie node capacity; exceeding it triggers decay-and-prune (a pass over
    # all nodes in Python: ~0.1 s at 65536 nodes, once per ~16k new nodes).
    trie_capacity: int = 1 << 16
    # Multiplier of the requesting request's own prompt counts vs output counts.
    prompt_weight: float = 1e4
    # Stop a branch once its path confidence falls below this floor. With the
    # forward-cost model off (cost_free_tokens=0) the floor is multiplied by
    # the number of requests drafting in the step, capped at 0.5 (a draft
    # token's worth shrinks with the batch, its cost does not); with it on,
    # the model prices each node against the step's load instead
    # (budget.confidence_floor). 0 drafts the full budget whenever a source matches.
    min_draft_confidence: float = 0.025
    # Draft tokens per engine step across the whole batch, given to the most
    # confident positions first (0 = no cap: decoding_length per request).
    step_draft_budget: int = 0
    # Forward-cost model (core/budget.py): a forward scoring up to
    # cost_free_tokens tokens costs about one token's forward; past that,
    # cost_marginal_tokens more tokens cost one more forward. Each step keeps
    # the batch's most confident draft nodes only while they raise expected
    # tokens per second. -1 (both) = measured online: the engine fits both
    # prices to its own decode steps' times (core/prices.py), starting from the
    # platform's defaults (budget.PLATFORM_TOKEN_COSTS: 5 and 20 measured on
    # this project's CPU, 64 and 64 on a GPU). Either one >= 0 pins both (the
    # other at its platform default); cost_free_tokens=0 turns the model off.
    cost_free_tokens: int = -1
    cost_marginal_tokens: float = -1.0
    # Extra cost, in forwards, of each root-to-leaf path a tree step's
    # attention runs separately (the CPU path rounds; the CUDA kernel does all
    # paths in one launch). -1 = the platform's measured model
    # (tree_verify.path_cost(): on the CPU 0.09 per step that runs any, plus
    # 0.02 per path).
    cost_per_path: float = -1.0
    # Learn how often draft nodes of each kind (leading chain, side branch,
    # Jacobi pool) and raw confidence are accepted, and hand the cost model
    # calibrated confidences (core/calibration.py).
    calibrate_confidence: bool = True
    # Load adaptation (see core/load.py): with more running requests than
    # load_shrink_above the per-request budget shrinks linearly; at
    # load_stop_at running requests or more nothing is drafted. -1: the
    # platform's default (core/load.py load_limits: 8 and 16 on the
    # CPU, 32 and 128 on GPUs, which verify many more tokens for free).
    load_shrink_above: int = -1
    load_stop_at: int = -1
    # Draft shape: "one" drafts a chain; "hier" a token tree with shared
    # prefixes merged, "par" whole branches side by side; trees are verified
    # in one forward with tree attention (vllm/tree_verify.py).
    draft_shape: str = "one"
    # Insert generated tokens into the trie (shared across requests).
    insert_output: bool = True
    # Insert prompt windows on admission.
    insert_prompt: bool = True
    # Where verify branches come from: "index" (core/draft_index.py: the
    # continuations of the longest earlier matches in the request's own text
    # and in every request's output; native, batched), "trie" (the n-gram
    # trie of core/trie.py with the context chain of core/context_match.py),
    # the Jacobi n-gram pool (core/jacobi.py), or several merged into one tree
    # in that order ("index+trie", "index+jacobi"; "both" = trie and Jacobi).
    # Sources with "jacobi" add the 2D lookahead window (jacobi_window *
    # (jacobi_ngram - 1) - 1 nodes) to every step on top of decoding_length
    # verify nodes; they need tree verification and greedy-compatible
    # sampling (any per-row sampling works).
    source: str = "index"
    # Draft index (source "index"): key length, how far matches are measured
    # backwards, candidates merged per draft, occurrences kept per key, and
    # the memory cap of the outputs kept for cross-request matches: the
    # corpus's charge in bytes (core/draft_index.py prices its texts,
    # entries and keys at what the native layout takes at most), split
    # evenly between the index and its back-off; the oldest finished outputs
    # are evicted first.
    index_ngram: int = 2
    # Back-off key length: where the index finds no match of index_ngram
    # tokens, a second index keyed by this many tokens drafts (0 = none).
    index_backoff: int = 1
    index_max_match: int = 64
    index_candidates: int = 16
    index_occurrences: int = 32
    index_corpus_bytes: int = 128 << 20
    # Threads the native index drafts a step's rows on (the drafts do not
    # depend on it; at least 32 rows a thread): 0 = min(4, usable cores).
    # 1 by default: on this project's 2-core host 2 threads made a 256-request
    # step slower (2.3-2.5 ms median vs 1.5-1.6, bench_proposer_scale).
    index_threads: int = 1
    # Where the native index runs its upkeep (core/draft_index.py: the
    # corpus pushes of the step's new output n-grams and the evictions of
    # finished outputs, done once the step's drafts are out): "thread" on a
    # thread of its own, while the forward runs; "inline" at the end of the
    # batch call; "auto" = "thread" on GPUs (the CPU waits out the forward
    # there), "inline" on the CPU platform (where the forward keeps the cores
    # busy: on the dev splits at batch 8 a thread gained nothing end to end
    # and its steps waited longer for it). The drafts are the same either way.
    index_upkeep: str = "auto"
    # Jacobi window columns W, n-gram size N (N - 1 window levels), and the
    # most pool n-grams verified per step / kept per first token G.
    jacobi_window: int = 4
    jacobi_ngram: int = 3
    jacobi_guesses: int = 4
    # Warm start: a file of past responses or a corpus, tokenized with the
    # model's tokenizer at engine start into the drafter's corpus (.jsonl: one
    # object a line with a "text", "response", "output" or "completion"
    # string; any other file: plain text, paragraphs split on blank lines).
    # "" = none.
    warm_start: str = ""
    # Snapshot (core/snapshot.py) of what the drafter learned: loaded on
    # start when the file exists, written on shutdown (atomically). A
    # corrupt or foreign file is refused with a warning; the engine starts
    # cold. "" = none.
    snapshot_path: str = ""
    # Tenant isolation (core/partitions.py): which finished outputs a request
    # drafts from besides its own text. "per-salt": a request carrying
    # vLLM's cache_salt drafts only from outputs of requests with the same
    # salt, requests without one share a default partition; "per-salt-saved":
    # the same, and the snapshot also keeps the salted partitions (each under
    # its salt's SHA-256, restored only to requests with that salt; otherwise
    # only the default partition is written); "all": every request drafts
    # from every output, salts ignored; "none": no cross-request drafting.
    draft_sharing: str = "per-salt"
    # Debug only: switch off pieces of tree verification ("positions", "mask",
    # "compaction") to prove each is needed; output is then NOT lossless.
    debug_disable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_int("decoding_length", self.decoding_length, 1, 256)
        _check_int("branch_length", self.branch_length, 2, 128)
        _check_int("max_match_length", self.max_match_length, 1, self.branch_length - 1)
        _check_int("min_match_length", self.min_match_length, 1, self.max_match_length)
        _check_int("min_retrieved_nodes", self.min_retrieved_nodes, 1, 1 << 16)
        _check_int("context_match", self.context_match, 0, 64)
        _check_int("trie_capacity", self.trie_capacity, 64, 1 << 26)
        _check_float("prompt_weight", self.prompt_weight, 0.0, 1e9)
        _check_int("step_draft_budget", self.step_draft_budget, 0, 1 << 16)
        _check_or_platform(_check_int, "cost_free_tokens", self.cost_free_tokens, 0, 1 << 16)
        _check_or_platform(_check_float, "cost_marginal_tokens", self.cost_marginal_tokens, 1.0, 1e6)
        _check_or_platform(_check_float, "cost_per_path", self.cost_per_path, 0.0, 100.0)
        _check_float("min_draft_confidence", self.min_draft_confidence, 0.0, 1.0)
        _check_or_platform(_check_int, "load_shrink_above", self.load_shrink_above, 0, 1 << 16)
        _check_or_platform(_check_int, "load_stop_at", self.load_stop_at, 1, (1 << 16) + 1)
        if self.load_shrink_above >= 0 and self.load_stop_at >= 0 and self.load_stop_at <= self.load_shrink_above:
            raise ValueError(f"load_stop_at={self.load_stop_at}: must be > load_shrink_above ({self.load_shrink_above})")
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r}: must be one of {SOURCES}")
        _check_int("index_ngram", self.index_ngram, 1, 4)
        _check_int("index_backoff", self.index_backoff, 0, max(0, self.index_ngram - 1))
        _check_int("index_max_match", self.index_max_match, self.index_ngram, 1 << 16)
        _check_int("index_candidates", self.index_candidates, 1, 1024)
        _check_int("index_occurrences", self.index_occurrences, 1, 1024)
        _check_int("index_corpus_bytes", self.index_corpus_bytes, 0, 1 << 40)
        _check_int("index_threads", self.index_threads, 0, 256)
        _check_int("jacobi_window", self.jacobi_window, 1, 64)
        _check_int("jacobi_ngram", self.jacobi_ngram, 2, 16)
        _check_int("jacobi_guesses", self.jacobi_guesses, 1, 64)
        if self.draft_sharing not in DRAFT_SHARINGS:
            raise ValueError(f"draft_sharing={self.draft_sharing!r}: must be one of {DRAFT_SHARINGS}")
        if self.index_upkeep not in INDEX_UPKEEPS:
            raise ValueError(f"index_upkeep={self.index_upkeep!r}: must be one of {INDEX_UPKEEPS}")
        if self.draft_shape not in DRAFT_SHAPES:
            raise ValueError(f"draft_shape={self.draft_shape!r}: must be one of {DRAFT_SHAPES}")
        if isinstance(self.debug_disable, (list, tuple)):
            object.__setattr__(self, "debug_disable", tuple(self.debug_disable))
        bad = [x for x in self.debug_disable if x not in DEBUG_SWITCHES] if isinstance(self.debug_disable, tuple) else [1]
        if bad:
            raise ValueError(f"debug_disable={self.debug_disable!r}: must be a list drawn from {DEBUG_SWITCHES}")
        for name in ("warm_start", "snapshot_path"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a file path (a string; \"\" = none)")
        for name in ("insert_output", "insert_prompt", "calibrate_confidence"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be true or false")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "LookaheadConfig":
        """Build from a user mapping; unknown keys are rejected by name."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for old, hint in RENAMED.items():
            if old in values:
                raise ValueError(f"{old}: renamed; use {hint}")
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown lookahead config key(s) {unknown}; allowed keys: {sorted(known)}"
            )
        return cls(**values)

    @property
    def sources(self) -> tuple[str, ...]:
        """The draft sources, in merge order."""
        return ("trie", "jacobi") if self.source == "both" else tuple(self.source.split("+"))

    @property
    def uses_index(self) -> bool:
        return "index" in self.sources

    @property
    def uses_trie(self) -> bool:
        return "trie" in self.sources

    @property
    def uses_jacobi(self) -> bool:
        return "jacobi" in self.sources

    def index_config(self, ngram: int | None = None) -> "DraftIndexConfig":
        """The draft index's settings (keyed by ``ngram`` tokens, default index_ngram)."""
        from lookahead_vllm.core.draft_index import DraftIndexConfig

        shares = 2 if self.index_backoff else 1  # the corpus cap, split evenly
        return DraftIndexConfig(ngram or self.index_ngram, self.index_max_match, self.index_occurrences,
                                self.index_candidates, self.index_corpus_bytes // shares)

    def upkeep_thread(self, platform: str) -> bool:
        """Whether the native index runs its upkeep on a thread on
        ``platform`` ("cpu" or "gpu"; see ``index_upkeep``)."""
        return self.index_upkeep == "thread" or (self.index_upkeep == "auto" and platform != "cpu")

    @property
    def draft_threads(self) -> int:
        """``index_threads``, with 0 resolved to min(4, the cores this process may use)."""
        if self.index_threads:
            return self.index_threads
        import os

        return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))

    @property
    def lookahead_nodes(self) -> int:
        """Jacobi window nodes per step: W * (N - 1) - 1 (0 for source="trie")."""
        return self.jacobi_window * (self.jacobi_ngram - 1) - 1 if self.uses_jacobi else 0

    @property
    def jacobi_step_slots(self) -> int:
        """Draft slots a full Jacobi step needs: the window plus G pool n-grams
        of N - 1 tokens, (W + G) * (N - 1) - 1 (the root is the step's own token)."""
        return (self.jacobi_window + self.jacobi_guesses) * (self.jacobi_ngram - 1) - 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_or_platform(check: Any, name: str, value: Any, lo: float, hi: float) -> None:
    """-1 (the platform's default) or a value ``check`` accepts."""
    if value == -1 and not isinstance(value, bool):
        return
    try:
        check(name, value, lo, hi)
    except ValueError:
        raise ValueError(f"{name}={value!r}: must be -1 (platform default) or in [{lo:g}, {hi:g}]") from None


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: must be a number in [{lo:g}, {hi:g}]")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r}: must be in [{lo:g}, {hi:g}]")


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: must be an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r}: must be in [{lo}, {hi}]")
