"""Tenant isolation end to end (SmolLM2, CPU, greedy): config ``draft_sharing``.

Two tenants send the same prompts with different ``cache_salt``s, tenant A
first. Every draft the proposer offers tenant B (what ``propose`` returns,
the drafts the draft trace records) is checked against tenant A's outputs:
a draft *leaks* when it holds a 4-gram of A's outputs that no text of B's
(its requests' texts so far, its earlier outputs) held yet when the draft
was offered. Greedy decoding gives B the same outputs as A, so B may draft
them only once one of its own requests wrote them. Under isolation no draft
leaks, at batch 1 and 8, before and after a restart from a snapshot (where
a third tenant, C, runs too); a proposer whose partitions ignore the salt
(the mutation) leaks, so the check can fail.
Greedy outputs equal plain vLLM's under every policy (the two per-salt
policies on the leak test's restarted engines, already built).
"""

from __future__ import annotations

import pytest

from lookahead_lab.offline import count_mismatches, generate
from lookahead_vllm.core.partitions import Partitions

from .conftest import plain_run

pytestmark = pytest.mark.vllm

NUM_PROMPTS = 8
MAX_TOKENS = 48
GRAM = 4


def _greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _salted(tokenizer, prompts: list[str], salt: str) -> list[dict]:
    return [{"prompt_token_ids": tokenizer(p, add_special_tokens=False)["input_ids"], "cache_salt": salt}
            for p in prompts]


def _grams(tokens) -> set[tuple[int, ...]]:
    tokens = [int(t) for t in tokens]
    return {tuple(tokens[i:i + GRAM]) for i in range(len(tokens) - GRAM + 1)}


def _own_grams(tokens) -> set[tuple[int, ...]]:
    """The 4-grams a request's own text drafts: its text's, and those of the
    periodic continuations past its end (core/draft_index.py: an own match at
    ``pos`` continues ``text[pos:]`` over and over)."""
    tokens = [int(t) for t in tokens]
    out, n = _grams(tokens), len(tokens)
    tail, starts = tokens[max(0, n - GRAM + 1):], range(min(GRAM - 1, n))
    for pos in range(n):
        head = tokens[pos:pos + GRAM - 1]  # the periodic continuation's first GRAM - 1 tokens
        if len(head) < GRAM - 1:
            head = (head * GRAM)[:GRAM - 1]
        ext = tail + head
        out.update(tuple(ext[i:i + GRAM]) for i in starts)
    return out


class DraftWatch:
    """Wraps the proposer's ``propose``: while ``watching`` (one tenant's
    requests run, the other's have finished), every draft offered is checked
    for 4-grams of ``secret`` that the watched tenant's texts (``seen``) lacked."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.original = proposer.propose
        self.secret: set[tuple[int, ...]] = set()
        self.watching = False
        self.seen: set[tuple[int, ...]] = set()
        self.leaks: list[tuple[str, list[int]]] = []
        self.offered = 0  # draft tokens offered to watched requests
        proposer.propose = self.propose

    def propose(self, sampled, num_tokens_no_spec, token_ids_cpu, *args, **kwargs):
        drafts = self.original(sampled, num_tokens_no_spec, token_ids_cpu, *args, **kwargs)
        if not self.watching:
            return drafts
        req_ids = self.proposer._input_batch.req_ids
        for row in range(len(req_ids)):  # the tenant's texts so far, every row of the batch
            self.seen |= _own_grams(token_ids_cpu[row, :int(num_tokens_no_spec[row])])
        for req_id, draft in zip(req_ids, drafts):
            self.offered += len(draft)
            if any(g in self.secret and g not in self.seen for g in _grams(draft)):
                self.leaks.append((req_id, list(draft)))
        return drafts

    def run(self, llm, prompts, bs: int, watch: bool):
        self.watching = watch
        out = []
        for lo in range(0, len(prompts), bs):
            out += llm.generate(prompts[lo:lo + bs], _greedy(), use_tqdm=False)
        self.watching = False
        outs = [list(o.outputs[0].token_ids) for o in out]
        if watch:
            self.seen |= set().union(*map(_grams, outs))
        return outs


def _run_tenants(engines, tokenizer, texts, name: str, lookahead: dict, bs: int, mutate=None):
    from lookahead_lab.offline import find_proposers

    llm = engines.get(name, lookahead=lookahead)
    (proposer,) = find_proposers(llm)
    if mutate is not None:
        mutate(proposer)
    watch = DraftWatch(proposer)
    outs_a = watch.run(llm, _salted(tokenizer, texts, "tenant-a"), bs, watch=False)
    watch.secret = set().union(*map(_grams, outs_a))
    outs_b = watch.run(llm, _salted(tokenizer, texts, "tenant-b"), bs, watch=True)
    return llm, watch, outs_a, outs_b


def _mixed_tenants_identical_to_plain(engines, tokenizer, prompts, llm):
    """One batch of 8 with two tenants' requests mixed: greedy output equals plain vLLM's."""
    texts = prompts["humaneval"][:NUM_PROMPTS]
    mixed = _salted(tokenizer, texts[:4], "tenant-a") + _salted(tokenizer, texts[4:], "tenant-b")
    plain = plain_run(engines, mixed, _greedy(), 8, ("humaneval-tenants", "greedy"))
    got = generate(llm, mixed, _greedy(), 8)
    assert count_mismatches(plain.token_ids, got.token_ids) == 0


# Batch 1 runs 1 prompt per tenant (4 tenant runs of one step per token; a
# leak shows on a tenant's first request: B's first request is A's, so every
# 4-gram of A's output is there to leak), batch 8 all NUM_PROMPTS.
@pytest.mark.parametrize("sharing,bs", [("per-salt", 1), ("per-salt-saved", 8)])
def test_no_draft_crosses_tenants(engines, tokenizer, prompts, tmp_path, sharing, bs):
    from lookahead_lab.offline import find_proposers

    texts = prompts["humaneval"][:NUM_PROMPTS if bs > 1 else 1]
    snap = tmp_path / "drafter.snap"
    name = f"lookahead-tenants-{sharing}-{bs}"
    lookahead = {"draft_sharing": sharing, "snapshot_path": str(snap)}
    _, watch, outs_a, outs_b = _run_tenants(engines, tokenizer, texts, name, lookahead, bs)
    assert watch.offered > 0 and watch.leaks == []
    engines.shutdown(name)  # writes the snapshot
    assert snap.exists()
    # Restarted from the snapshot: tenant C (no text of its own yet), then B
    # again (its own earlier outputs are its to draft from where they were saved).
    llm = engines.get(name + "-restarted", lookahead=lookahead)
    (proposer,) = find_proposers(llm)
    secret = set().union(*map(_grams, outs_a))
    for tenant, seen in (("tenant-c", set()), ("tenant-b", set().union(*map(_grams, outs_b)))):
        watch = DraftWatch(proposer)
        watch.secret, watch.seen = secret, seen
        watch.run(llm, _salted(tokenizer, texts, tenant), bs, watch=True)
        proposer.propose = watch.original
        assert watch.offered > 0 and watch.leaks == [], tenant
    # test_greedy_identical_to_plain_under_every_policy's check for this policy.
    _mixed_tenants_identical_to_plain(engines, tokenizer, prompts, llm)
    engines.shutdown(name + "-restarted")


def test_a_drafter_that_ignores_the_salt_leaks(engines, tokenizer, prompts, monkeypatch):
    """The mutation: partitions that ignore the salt (as "all" does). The same
    check then finds A's text in B's drafts."""
    texts = prompts["humaneval"][:NUM_PROMPTS]
    monkeypatch.setattr(Partitions, "of_salt", lambda self, salt: 0)
    _, watch, _, _ = _run_tenants(engines, tokenizer, texts, "lookahead-tenants-mutant", {}, 8)
    engines.shutdown("lookahead-tenants-mutant")
    assert watch.leaks, "a drafter sharing every output across tenants must show up as leaks"


# "per-salt" and "per-salt-saved" are checked the same way in
# test_no_draft_crosses_tenants, on its restarted engines (two builds fewer).
@pytest.mark.parametrize("sharing", ["all", "none"])
def test_greedy_identical_to_plain_under_every_policy(engines, tokenizer, prompts, sharing):
    name = f"lookahead-sharing-{sharing}"
    _mixed_tenants_identical_to_plain(engines, tokenizer, prompts,
                                      engines.get(name, lookahead={"draft_sharing": sharing}))
    engines.shutdown(name)
