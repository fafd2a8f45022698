"""A flood of long prompts through the proposer: memory stays under the
drafter's cap and nothing of a request is left after it finishes or aborts.

The draft index keeps a running request's whole text (prompt and output) and,
once it finishes, only its output, in a corpus capped at
``index_corpus_bytes`` (its charge, oldest outputs evicted first; split
between the index and its back-off). So with every request finished, the
drafter holds at most the cap however many long prompts went through; while
requests run it holds their texts.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

# Real text that stays put (a past README of this project), unlike the README itself.
TEXT = Path(__file__).resolve().parents[1] / "data" / "real_text.md"
PROMPT, OUTPUT, BATCH, CAP = 3000, 120, 16, 400_000


def _text(rng, text, n):
    start = int(rng.integers(0, len(text) - n))
    return text[start:start + n]


def test_long_prompt_flood_stays_under_the_cap_and_leaves_no_state():
    from lookahead_lab.standalone import standalone_proposer

    proposer = standalone_proposer(8, PROMPT + OUTPUT + 8, {"index_corpus_bytes": CAP})
    empty = proposer.drafter.memory_bytes()
    rng = np.random.default_rng(0)
    text = np.frombuffer(TEXT.read_bytes() * 2, np.uint8).astype(np.int64)
    held_after_wave = []
    for wave in range(12):  # 12 waves of 16 requests with 3000-token prompts
        ids = [f"w{wave}r{i}" for i in range(BATCH)]
        texts = np.stack([_text(rng, text, PROMPT + OUTPUT) for _ in ids])
        table = np.zeros((BATCH, PROMPT + OUTPUT + 8), np.int64)
        table[:, :PROMPT + OUTPUT] = texts
        batch = SimpleNamespace(req_ids=ids, num_prompt_tokens=np.full(BATCH, PROMPT))
        num_tokens = np.full(BATCH, PROMPT + 1)
        proposer.on_step(batch, [], {})
        while num_tokens[0] < PROMPT + OUTPUT:
            proposer.propose([[int(table[i, n - 1])] for i, n in enumerate(num_tokens)], num_tokens, table)
            num_tokens += 4
            proposer.on_step(batch, [], {})
        assert proposer.num_request_states() == BATCH
        # Half finish, half are aborted (vLLM reports both as finished ids).
        proposer.on_step(SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(0)), ids, {})
        assert proposer.num_request_states() == 0 and proposer.drafter.num_requests() == 0
        indexes = (proposer.drafter.index, proposer.drafter.backoff)
        assert sum(index.corpus_bytes() for index in indexes) <= CAP
        held_after_wave.append(proposer.drafter.memory_bytes())
        # What the corpus holds is within its charge: the memory over an empty drafter's is under the cap.
        assert held_after_wave[-1] - empty <= CAP, (wave, held_after_wave[-1] - empty)
    assert proposer.drafter.index.corpus_tokens() < 12 * BATCH * OUTPUT  # the cap evicted outputs
    # What is held after a wave does not grow with the number of waves: the
    # 12th wave leaves no more than the 8th (both corpora were full by then).
    assert held_after_wave[-1] <= held_after_wave[7] * 1.05, held_after_wave
    # And it is about the corpus's worth, not the prompts': well under the
    # ~8 bytes per token one wave's 48k running prompt tokens alone take.
    assert held_after_wave[-1] < 8 * BATCH * PROMPT, held_after_wave
