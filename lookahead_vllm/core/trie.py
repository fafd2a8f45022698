"""Global token trie of prompt and output n-grams (seed 000, section 4.3), one per engine, shared by every request
(native: ``csrc/draft_index/token_trie.h``, each request's record by slot; reference: ``lookahead_lab.reference.trie``).
A path from the (token-less) root is an n-gram; a node counts the inserted windows through it: ``out`` (float,
decays on pruning) of generated text, inserted every step, and warm-up text, and per-request prompt counts
(``{slot: count}``) of every window ``P[i:i+branch_length]`` of a request's prompt, from admission until it
finishes or aborts. Retrieval matches the longest trailing context first, then picks the highest-weighted nodes
below the match within the node budget, ``weight = prompt_weight * own_prompt + other_prompts + out``; a chain
tries shorter matches while a match yields under ``min_retrieved_nodes`` nodes and keeps the largest draft; a tree
adds the shorter matches' branches below the longer ones' until the budget is full. Past ``trie_capacity`` nodes
the trie halves output counts, drops nodes whose weight fell below one, then the lightest leaves to 75% of it.

A request's *context chain* (profile ``context_match`` = ``m``): the tokens (at most 32) that followed the one of
the latest 8 earlier occurrences of its last ``m`` tokens whose match extends furthest backwards, the period
repeated where they run into the sequence's end; a match of ``l`` tokens drafts at confidence
``(l / (l + 1)) ** depth``. It leads a request's draft where the index has none (the trie cuts branches at
``branch_length``). Example (``m = 2``): ``a b c d x a b`` ends with ``a b``, seen at 0..1 and followed by
``c d x a b``: the chain is ``c d x a`` for a budget of 4.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from lookahead_vllm.core import native
from lookahead_vllm.core.config import Settings


class NativeTrie:
    """The native trie (``csrc/draft_index/token_trie.h``), its requests by the caller's slot."""

    def __init__(self, config: Settings, core: Any) -> None:
        self.config = config
        self._core = core

    num_nodes = property(lambda self: self._core.num_nodes)
    num_bytes = property(lambda self: self._core.memory_bytes())
    num_slots = property(lambda self: self._core.num_slots)
    num_slot_contexts = property(lambda self: self._core.num_slot_contexts)

    def insert_output(self, tokens: Sequence[int]) -> None:
        self._core.insert_output(tokens)

    def sync(self, slots: np.ndarray, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
             prompt_lens: np.ndarray, partitions: np.ndarray | None = None, sampled: np.ndarray | None = None) -> int:
        """Slot ``slots[i]`` has ``token_ids[rows[i], :num_tokens[i]]`` (the first ``prompt_lens[i]``: its prompt, the
        last ``sampled[i]``: this step's) in ``partitions[i]`` (the default one's share the trie). Returns rewinds."""
        return self._core.sync(slots, rows, token_ids, num_tokens, prompt_lens, partitions, sampled)

    def finish_slot(self, slot: int) -> None:
        self._core.finish_slot(slot)

    def retrieve_slots(self, slots: np.ndarray, contexts: np.ndarray, context_lens: np.ndarray,
                       budgets: np.ndarray, floor: float, shape: str | None = None) -> tuple[np.ndarray, ...]:
        """The rows' trees by slot, and per row whether its slot drafts from the trie (a slot kept off it
        drafts nothing; one never synced drafts with no record)."""
        return self._core.retrieve_slots(slots, contexts, context_lens, budgets, float(floor),
                                         shape or self.config.draft_shape)

    def context_slots(self, slots: np.ndarray, budgets: np.ndarray, floor: float) -> tuple[np.ndarray, ...]:
        return self._core.context_slots(slots, budgets, float(floor))

    def slot_context_length(self, slot: int) -> int:
        """Tokens in the slot's context chain (-1: it has none)."""
        return self._core.slot_context_length(slot)

    def output_counts(self) -> tuple[list[int], list[int], list[float]]:
        return self._core.output_counts()

    def load_output_counts(self, parents: Sequence[int], tokens: Sequence[int], counts: Sequence[float]) -> None:
        self._core.load_output_counts(parents, tokens, counts)


def make_trie(config: Settings, kind: type[NativeTrie] = NativeTrie) -> NativeTrie:
    """The engine's trie for ``config``, a :class:`NativeTrie` or subclass ``kind`` (ImportError: no extension)."""
    k = config.profile
    core = native.extension().TokenTrie(
        k.branch_length, k.max_match_length, k.min_match_length, k.min_retrieved_nodes, k.trie_capacity,
        float(k.prompt_weight), bool(k.insert_prompt), k.context_match)
    return kind(config, core)
