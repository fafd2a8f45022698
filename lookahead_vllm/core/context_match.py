"""Context match: draft what followed the last n-gram's earlier occurrence in
the request's own tokens (prompt and output).

The trie (core/trie.py) merges every request's n-grams and cuts a branch at
``branch_length`` tokens, so when a request repeats a long stretch of its own
text (code that reuses a signature, an answer quoting the question, a list
that follows a pattern) the trie offers a short, often mixed-up continuation
where prompt lookup (vLLM's ``ngram`` method) would copy ``k`` tokens that are
almost all accepted. Replaying 32 prompts per dataset with plain vLLM's greedy
outputs, at the steps where the last 5 tokens had occurred before in the
request, the 16 tokens that followed them would have been accepted up to 1121
times on HumanEval and 2493 times on MT-Bench; the trie's 16-node ``hier``
drafts got 848 and 1102 at those steps.

The proposer therefore puts the *context chain* first in every request's draft
and merges the trie's tree (and the Jacobi pool's n-grams) after it, shared
prefixes merged:

  match     the last ``min_match`` tokens of the sequence; among its
            ``RECENT_OCCURRENCES`` most recent earlier occurrences the one
            whose match extends furthest backwards wins (ties: the latest).
  chain     the tokens that followed the winner, at most ``budget``; where
            they run into the sequence's end the text is periodic and the
            chain repeats the period (``a b a b a`` drafts ``b a b a``).
  confidence  ``q ** depth`` with ``q = m / (m + 1)`` for a match of ``m``
            tokens (Laplace's rule: the earlier text has agreed with the
            current one ``m`` times in a row), so a 3-token match drafts at
            0.75 per token and a 31-token one at 0.97. The calibrator of
            core/calibration.py learns the real acceptance per raw-confidence
            bin, node kind ``context``; the chain stops below the step's floor.
            Only the rate matters where draft tokens cost time (batch 8 on the
            CPU): replaying 32 prompts per dataset at batch 8
            (``sim_acceptance.py --batch 8``), a flat 0.9 modeled 1.474x
            (HumanEval) and 1.035x (MT-Bench) over plain decoding, ``m / (m + 1)``
            1.500x and 1.074x; at batch 1, 2.08x / 1.70x either way.

Worked example (``min_match=2``): tokens ``a b c d x a b`` end with ``a b``,
which occurred at 0..1 followed by ``c d x a b``: the chain is ``c d x a``
for a budget of 4.
"""

from __future__ import annotations

from typing import Sequence

from lookahead_vllm.core.draft_tree import DraftTree

# Earlier occurrences of the trailing n-gram kept per n-gram (most recent).
RECENT_OCCURRENCES = 8
# A backward match is extended at most this far (tokens) to rank occurrences.
MAX_MATCH = 32
# Ranking weight of chain nodes: above any trie count, so a chain-mode draft
# (the tree's best path) follows the context chain.
CONTEXT_WEIGHT = 1e18


class ContextIndex:
    """One request's tokens and, per ``min_match``-gram, where its most recent
    occurrences were followed by more tokens."""

    def __init__(self, min_match: int, tokens: Sequence[int] = ()) -> None:
        if min_match < 1:
            raise ValueError(f"min_match={min_match!r}: must be >= 1")
        self.min_match = min_match
        self.tokens: list[int] = []
        # n-gram -> positions of the token that followed it (ascending, at most RECENT_OCCURRENCES).
        self._next: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; index every n-gram that now has a follower."""
        n, seq = self.min_match, self.tokens
        start = max(n, len(seq))  # first follower position not indexed yet
        seq.extend(int(t) for t in tokens)
        for p in range(start, len(seq)):
            follows = self._next.setdefault(tuple(seq[p - n:p]), [])
            follows.append(p)
            if len(follows) > RECENT_OCCURRENCES:
                del follows[0]

    def match(self) -> tuple[int, int]:
        """(position where the continuation starts, match length), or (-1, 0)."""
        n, seq = self.min_match, self.tokens
        end = len(seq)
        if end <= n:
            return -1, 0
        best, best_len = -1, 0
        for p in reversed(self._next.get(tuple(seq[end - n:]), ())):
            length = n
            while length < MAX_MATCH and p - length - 1 >= 0 and seq[p - length - 1] == seq[end - length - 1]:
                length += 1
            if length > best_len:
                best, best_len = p, length
        return best, best_len

    def draft(self, budget: int, floor: float = 0.0) -> DraftTree:
        """The context chain (at most ``budget`` nodes, confidence >= ``floor``)."""
        start, length = self.match()
        if start < 0 or budget <= 0:
            return DraftTree.empty()
        tokens = self.tokens[start:start + budget]
        period = len(self.tokens) - start
        while len(tokens) < budget:  # the continuation reached the end: it repeats with the period
            tokens.append(tokens[len(tokens) - period])
        rate = match_confidence(length)
        confs = [rate ** d for d in range(1, len(tokens) + 1)]
        keep = sum(1 for c in confs if c >= floor)
        return DraftTree(
            tuple(tokens[:keep]), tuple(range(-1, keep - 1)), (CONTEXT_WEIGHT,) * keep, tuple(confs[:keep])
        )


def match_confidence(length: int) -> float:
    """Per-token raw confidence of a context chain whose match is ``length``
    tokens long: ``length / (length + 1)``."""
    return length / (length + 1)
